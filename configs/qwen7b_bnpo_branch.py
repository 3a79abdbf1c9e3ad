"""BNPO + Branch on Qwen2.5-Math-7B.

    python -m sage_jax.train --config configs/qwen7b_bnpo_branch.py --workdir gs://BUCKET/qwen7b_bnpo_branch

Hardware: TPU v5p-64. Should produce (paper): pass@1 0.271, pass@256 0.715 (BNPO: 0.243 / 0.699).
"""

from configs import qwen7b_bnpo

ARGS = ()  # accepted config arguments (configs/NAME.py:ARG): none, so any is an error


def get_config(arg=None):
    c = qwen7b_bnpo.get_config(arg)
    c.loss.guide = "branch"
    return c
