"""DAPO on Qwen2.5-Math-7B: clip-higher (eps_high 0.28), token-mean loss, dynamic sampling, overlong shaping.

    python -m sage_jax.train --config configs/qwen7b_dapo.py --workdir gs://BUCKET/qwen7b_dapo

Turns on all four DAPO parts: clip-higher 0.2/0.28, token-mean aggregation, dynamic sampling (groups whose accuracy
is all 0 or all 1 are dropped and refilled, up to 3 resamples) and the soft overlong penalty over the last 512
tokens; it keeps the k3 anchor (beta 0.05), which DAPO itself drops. The authors' DAPO row most likely changed only
the loss type (TRL's loss_type="dapo", a token-mean like qwen7b_bnpo.py); for that run, add
--config.loss.eps_high=0.2 --config.train.dynamic_sampling=False --config.train.overlong_buffer=0.
Hardware: TPU v5p-64. Should produce (paper): pass@1 0.264, pass@256 0.696.
"""

from configs import paper

ARGS = ()  # accepted config arguments (configs/NAME.py:ARG): none, so any is an error


def get_config(arg=None):
    c = paper.get_config(arg)
    c.loss.update(eps_high=0.28, aggregation="token-mean")
    c.train.update(dynamic_sampling=True, overlong_buffer=512)
    return c
