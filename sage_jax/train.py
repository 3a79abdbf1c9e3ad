"""python -m sage_jax.train --config configs/NAME.py[:arg] --workdir DIR [--config.key=value ...]"""

from sage_jax.run import cli


def main(argv=None) -> int:
    config, args = cli.parse(argv, "SAGE / GRPO-family RL training")
    cli.setup_runtime(args.workdir)
    from sage_jax.training import trainer
    trainer.run(config, args.workdir)
    return 0


if __name__ == "__main__":
    cli.main_guard(main)
