"""The benchmarks live in the sage_jax.bench package (`python -m sage_jax.bench MODE ...`); this module keeps the
names that roofline.py and tests read from here: the benchmarks' FLOP model and the SAGE arm's settings."""

from sage_jax.bench.common import OPTIM, SAGE_LOSS  # noqa: F401
from sage_jax.bench.flops import decode_flops, rl_step_flops, train_flops  # noqa: F401
