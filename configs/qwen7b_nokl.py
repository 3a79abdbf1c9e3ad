"""GRPO without the KL anchor (beta = 0) on Qwen2.5-Math-7B.

    python -m sage_jax.train --config configs/qwen7b_nokl.py --workdir gs://BUCKET/qwen7b_nokl

Hardware: TPU v5p-64. Paper: higher training reward, worse test pass@1 and pass@256 than GRPO (reward hacking).
"""

from configs import paper

ARGS = ()  # accepted config arguments (configs/NAME.py:ARG): none, so any is an error


def get_config(arg=None):
    c = paper.get_config(arg)
    c.loss.update(kl_estimator="none", beta=0.0)
    return c
