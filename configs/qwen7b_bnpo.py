"""BNPO on Qwen2.5-Math-7B: the loss normalised by the number of tokens in the batch (token-mean).

    python -m sage_jax.train --config configs/qwen7b_bnpo.py --workdir gs://BUCKET/qwen7b_bnpo

Hardware: TPU v5p-64. Should produce (paper): pass@1 0.243, pass@256 0.699.
"""

from configs import paper


def get_config(arg=None):
    c = paper.get_config(arg)
    c.loss.aggregation = "token-mean"
    return c
