"""Plain GRPO (reverse-KL k3 anchor to pi_ref, q = 1) on Qwen2.5-Math-7B: the baseline.

    python -m sage_jax.train --config configs/qwen7b_grpo.py --workdir gs://BUCKET/qwen7b_grpo

Hardware: TPU v5p-64. Should produce (paper): pass@1 0.266, pass@256 0.714.
"""

from configs import paper

ARGS = ()  # accepted config arguments (configs/NAME.py:ARG): none, so any is an error


def get_config(arg=None):
    return paper.get_config(arg)
