"""python -m sage_jax.train --config configs/NAME.py[:arg] --workdir DIR [--config.key=value ...]"""

from sage_jax.run import cli


def main(argv=None) -> int:
    config, args = cli.parse(argv, "SAGE / GRPO-family RL training")
    from sage_jax.training import preflight, trainer
    prepared = cli.setup_runtime(args.workdir, lambda: preflight.check(config, args.workdir))
    trainer.run(config, args.workdir, prepared)
    return 0


if __name__ == "__main__":
    cli.main_guard(main)
