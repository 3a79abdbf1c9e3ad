"""Tokens/s of the sampler and of the train step vs batch and vs completion length; an optional two-panel plot."""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import numpy as np

from sage_jax.sampling import sampler
from sage_jax.bench import common, train_step
from sage_jax.bench.common import print_table


def bench_scaling(preset: str = "tiny", dtype: str = "fp32", batches=(1, 4, 16, 64), lengths=(32, 64, 128, 256, 512),
                  fixed_batch: int = 16, fixed_len: int = 128, prompt_len: int = 32, repeats: int = 3,
                  plot: str | None = None, seed: int = 0) -> list[dict]:
    """Tokens/s of sampler.generate (generated tokens, temperature 1, forced length) and of the train step (all
    prompt + completion tokens) vs batch at `fixed_len` new tokens, and vs new tokens at `fixed_batch` rows."""
    cfg = common.preset_config(preset, dtype)
    params = common.init_params(cfg, seed)
    rng = np.random.default_rng(seed)
    points = sorted({(b, fixed_len) for b in batches} | {(fixed_batch, n) for n in lengths})
    fns, tokens = {}, {}
    for b, n in points:
        prompts = rng.integers(1, cfg.vocab_size, (b, prompt_len)).tolist()
        fns[("sampler", b, n)] = lambda p=prompts, n=n: sampler.generate(cfg, params, p, n, temperature=1.0,
                                                                         eos_ids=(), seed=seed).tokens
        fns[("train_step", b, n)] = train_step.train_runner(cfg, b, prompt_len, n, seed)[0]
        tokens[("sampler", b, n)], tokens[("train_step", b, n)] = b * n, b * (prompt_len + n)
    times = common.interleaved_seconds(fns, repeats)
    out = []
    for (kind, b, n), t in times.items():
        s = statistics.median(t)
        for sweep in (["batch"] if n == fixed_len else []) + (["length"] if b == fixed_batch else []):
            out.append(dict(preset=preset, dtype=dtype, kind=kind, sweep=sweep, batch=b, prompt_len=prompt_len,
                            new_tokens=n, seconds=s, tokens_per_s=tokens[(kind, b, n)] / s))
    out.sort(key=lambda r: (r["sweep"], r["kind"], r["batch"], r["new_tokens"]))
    print_table(out, [("kind", ""), ("sweep", ""), ("batch", "d"), ("new_tokens", "d"), ("seconds", ".3f"),
                      ("tokens_per_s", ".0f")])
    if plot:
        plot_scaling(out, plot)
    return out


def plot_scaling(rows: list[dict], path: str) -> None:
    """Two panels: tokens/s vs batch, tokens/s vs new tokens; one line per kind."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    labels = {"sampler": "sampler (generated tokens/s)", "train_step": "train step (prompt+completion tokens/s)"}
    for ax, sweep, key, xlabel in ((axes[0], "batch", "batch", "batch (rows)"),
                                   (axes[1], "length", "new_tokens", "new tokens (completion length)")):
        for kind, label in labels.items():
            pts = sorted((r[key], r["tokens_per_s"]) for r in rows if r["kind"] == kind and r["sweep"] == sweep)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        fixed = next((r for r in rows if r["sweep"] == sweep), None)
        detail = f"{fixed['new_tokens']} new tokens" if sweep == "batch" and fixed else \
            f"batch {fixed['batch']}" if fixed else ""
        ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel="tokens / s", title=f"vs {sweep} ({detail})")
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    first = rows[0] if rows else {}
    fig.suptitle(f"{first.get('preset', '')} preset, {first.get('dtype', '')}, prompt {first.get('prompt_len', '')} "
                 f"tokens, CPU ({os.cpu_count()} cores)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def scaling_mode(args) -> list[dict]:
    return bench_scaling("tiny" if args.preset == "both" else args.preset, args.dtype, repeats=args.repeats,
                         plot=args.plot)
