"""python -m sage_jax.plan --config configs/NAME.py [flags]: see sage_jax/plan/memory.py (what it plans) and cli.py."""

import sys

from sage_jax.plan import cli as plan_cli

if __name__ == "__main__":
    if not plan_cli.cpu_check(sys.argv[1:]):
        plan_cli.prepare(plan_cli.parse_flags(sys.argv[1:])[0])  # before run.cli imports anything that imports JAX
    from sage_jax.run import cli
    cli.main_guard(plan_cli.main)
