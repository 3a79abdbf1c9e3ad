"""GRPO with a forward-KL anchor KL(pi_ref || pi) (importance-weighted from policy samples) on Qwen2.5-Math-7B.

    python -m sage_jax.train --config configs/qwen7b_fkl.py --workdir gs://BUCKET/qwen7b_fkl

Hardware: TPU v5p-64. Paper: pass@256 slightly above GRPO, pass@1 below SAGE.
"""

from configs import paper


def get_config(arg=None):
    c = paper.get_config(arg)
    c.loss.kl_estimator = "forward"
    return c
