"""DAPO on Qwen2.5-Math-7B: clip-higher (0.2/0.28), token-mean loss, dynamic sampling, overlong shaping; k3 anchor kept.

    python -m sage_jax.train --config configs/qwen7b_dapo.py --workdir gs://BUCKET/qwen7b_dapo

Hardware: TPU v5p-64. Should produce (paper): pass@1 0.264, pass@256 0.696.
"""

from configs import paper


def get_config(arg=None):
    c = paper.get_config(arg)
    c.loss.update(eps_low=0.2, eps_high=0.28, aggregation="token-mean")
    c.train.update(dynamic_sampling=True, max_resample=3, overlong_buffer=512, overlong_penalty=1.0)
    return c
