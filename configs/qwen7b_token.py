"""GRPO + Token guide (per-sequence normalised surprisal; alpha 0.3->0.1, sigma 0.25->0.1, cosine, 8 cycles).

    python -m sage_jax.train --config configs/qwen7b_token.py --workdir gs://BUCKET/qwen7b_token

Hardware: TPU v5p-64. Paper: gains over GRPO, below Branch (surprisal tracks lexical, not structural, choices).
"""

from configs import paper


def get_config(arg=None):
    c = paper.get_config(arg)
    c.loss.update(guide="token", token_alpha=0.3, token_alpha_end=0.1, token_sigma=0.25, token_sigma_end=0.1,
                  token_norm="minmax", token_quantiles=(0.05, 0.95))
    return c
