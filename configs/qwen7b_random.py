"""GRPO + Random guide (q = 1 + std * N(0,1) on a random eps share of tokens; eps 0.1->0, std 0.15->0.05).

    python -m sage_jax.train --config configs/qwen7b_random.py --workdir gs://BUCKET/qwen7b_random

Hardware: TPU v5p-64. Paper: a control for Branch; small or no gains over GRPO.
"""

from configs import paper

ARGS = ()  # accepted config arguments (configs/NAME.py:ARG): none, so any is an error


def get_config(arg=None):
    c = paper.get_config(arg)
    c.loss.guide = "random"  # eps 0.1 -> 0, std 0.15 -> 0.05: the defaults
    return c
