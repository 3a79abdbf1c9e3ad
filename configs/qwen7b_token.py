"""GRPO + Token guide (per-sequence normalised surprisal; alpha 0.3->0.1, sigma 0.25->0.1, cosine, 8 cycles).

    python -m sage_jax.train --config configs/qwen7b_token.py --workdir gs://BUCKET/qwen7b_token

Hardware: TPU v5p-64. Paper: gains over GRPO, below Branch (surprisal tracks lexical, not structural, choices).
"""

from configs import paper

ARGS = ()  # accepted config arguments (configs/NAME.py:ARG): none, so any is an error


def get_config(arg=None):
    c = paper.get_config(arg)
    c.loss.guide = "token"  # alpha 0.3 -> 0.1, sigma 0.25 -> 0.1, min-max in 5-95% quantiles: the defaults
    return c
