"""python -m sage_jax.bench MODE [flags]: see sage_jax/bench/cli.py."""

from sage_jax.run import cli  # first: it picks the platform before anything imports jax
from sage_jax.bench import cli as bench_cli


def _run() -> int:
    bench_cli.main()
    return 0


if __name__ == "__main__":
    cli.main_guard(_run)
