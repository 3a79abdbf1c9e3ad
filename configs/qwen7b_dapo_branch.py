"""DAPO + Branch on Qwen2.5-Math-7B.

    python -m sage_jax.train --config configs/qwen7b_dapo_branch.py --workdir gs://BUCKET/qwen7b_dapo_branch

Hardware: TPU v5p-64. Should produce (paper): pass@1 0.267, pass@256 0.712 (DAPO: 0.264 / 0.696).
"""

from configs import qwen7b_dapo

ARGS = ()  # accepted config arguments (configs/NAME.py:ARG): none, so any is an error


def get_config(arg=None):
    c = qwen7b_dapo.get_config(arg)
    c.loss.guide = "branch"
    return c
