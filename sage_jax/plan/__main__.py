"""python -m sage_jax.plan --config configs/NAME.py [flags]: see sage_jax/plan/memory.py."""

import sys

from sage_jax.plan import memory

if __name__ == "__main__":
    if not memory._cpu_check(sys.argv[1:]):
        memory.prepare(memory.parse_flags(sys.argv[1:])[0])  # before cli imports anything that imports JAX
    from sage_jax.run import cli
    cli.main_guard(memory.main)
