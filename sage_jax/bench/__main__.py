"""python -m sage_jax.bench MODE [flags]: see sage_jax/bench/cli.py."""

from sage_jax.run import cli  # first: it picks the platform before anything imports jax
from sage_jax.run import guard as run_guard
from sage_jax.bench import cli as bench_cli


def _run() -> int:
    try:
        bench_cli.main()
    except KeyboardInterrupt as e:  # a benchmark has no checkpoint to resume from: the guard's line would say so
        code = 143 if isinstance(e, run_guard.Terminated) else 130
        what = "terminated (SIGTERM)" if code == 143 else "interrupted"
        raise run_guard.Stopped(code, f"\n{what}: a benchmark keeps nothing between runs; rerun the command to "
                                      "measure again") from None
    return 0


if __name__ == "__main__":
    cli.main_guard(_run)
