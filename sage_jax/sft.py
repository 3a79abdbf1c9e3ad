"""python -m sage_jax.sft --config configs/NAME.py[:arg] --workdir DIR [--config.key=value ...]

Supervised warm-start only; `train` runs it automatically first when config.sft.steps > 0.
"""

from sage_jax.run import cli


def main(argv=None) -> int:
    config, args = cli.parse(argv, "supervised fine-tuning on demonstrations")
    import os
    from sage_jax.run import checkpoint
    from sage_jax.training import preflight, supervised
    prepared = cli.setup_runtime(args.workdir, lambda: preflight.check(config, args.workdir, rl=False))
    cfg, params = supervised.run_sft(config, os.path.join(args.workdir, "sft"), prepared.task, prepared.sft_data)
    out = checkpoint.export_hf(os.path.join(args.workdir, "sft"), cfg, params, prepared.task.tokenizer)
    print(f"SFT done: {out}")
    return 0


if __name__ == "__main__":
    cli.main_guard(main)
