"""What every benchmark mode shares: interleaved timing, the matmul peak, the SAGE arm's settings, tables, JSON."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

from sage_jax.bench import compiles
from sage_jax.run import config as config_lib
from sage_jax.models import decoder as model
from sage_jax.rl import guides, objectives

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
REPO = Path(__file__).resolve().parents[2]
# the default SAGE arm: the loss defaults (k3 anchor, beta 0.05, GRPO aggregation) with the Branch guide, and the
# optimizer of configs/base.py: one source for both
SAGE_LOSS = objectives.LossConfig(guide=guides.GuideConfig(name="branch"))
OPTIM = config_lib.load(str(REPO / "configs" / "base.py")).optim


def count(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= minimum (a bad one is argparse's one-line usage error, exit 2)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        return value
    parse.__name__ = f"integer >= {minimum}"  # argparse names the type in its message
    return parse


def interleaved_seconds(fns: dict[Any, Callable[[], Any]], repeats: int,
                        compiled: dict[Any, list[int]] | None = None) -> dict[Any, list[float]]:
    """Seconds of each fn per round: one warm-up call each, then `repeats` rounds calling each once. Each round
    starts one further down the list, so no fn always runs first (or right after the same neighbour). compiled: if
    given, gets per fn the XLA compilations of each timed call (compiles.CompileCounter), so that a caller can leave
    out the calls that compiled."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    names = list(fns)
    times: dict[Any, list[float]] = {name: [] for name in fns}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            with compiles.CompileCounter() as counted:
                start = time.perf_counter()
                jax.block_until_ready(fns[name]())
                times[name].append(time.perf_counter() - start)
            if compiled is not None:
                compiled.setdefault(name, []).append(counted.count)
    return times


def uncompiled_median(seconds: list[float], compiled: list[int]) -> float:
    """The median of the calls that compiled nothing (all calls when every one compiled)."""
    clean = [s for s, c in zip(seconds, compiled) if not c]
    return statistics.median(clean or seconds)


def matmul_peak_fn(dtype: str, size: int = 2048, calls: int = 4) -> tuple[Callable[[], Any], float]:
    """(fn, flops): `calls` jitted [size, size] @ [size, size] (bf16 inputs accumulate in fp32 for "bf16"); several
    calls so each timing spans long enough to see the same load as the step it is compared with."""
    a = jax.random.normal(jax.random.key(1), (size, size), jnp.float32).astype(DTYPES[dtype])
    mm = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32))
    return (lambda: [mm(a) for _ in range(calls)]), 2.0 * size ** 3 * calls


def preset_config(preset: str, dtype: str, **overrides) -> model.ModelConfig:
    """Params in fp32 for training (bf16 only as the compute dtype, as configs/base.py does)."""
    return model.preset(preset, **{"param_dtype": "float32", "compute_dtype": DTYPES[dtype], "eos_token_ids": (),
                                   **overrides})


def init_params(cfg: model.ModelConfig, seed: int = 0):
    return jax.jit(model.init_params, static_argnums=0)(cfg, jax.random.key(seed))


def presets(preset: str) -> tuple[str, ...]:
    """--preset's value as the presets to run ("both": tiny and small)."""
    return ("tiny", "small") if preset == "both" else (preset,)


def load_average() -> float:
    return os.getloadavg()[0]


def print_table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """columns: (key, format spec); a missing key prints as '-'."""
    cell = lambda r, k, f: format(r[k], f) if r.get(k) is not None else "-"
    widths = {k: max(len(k), *(len(cell(r, k, f)) for r in rows)) for k, f in columns}
    print("  ".join(k.rjust(widths[k]) for k, _ in columns))
    for r in rows:
        print("  ".join(cell(r, k, f).rjust(widths[k]) for k, f in columns))


def write_json(path: str, results: dict[str, Any]) -> None:
    """{"modes": {mode: rows}, "load_avg_1min", "cores"} to path ("-": one line on stdout)."""
    payload = {"modes": results, "load_avg_1min": load_average(), "cores": os.cpu_count()}
    text = json.dumps(payload, default=lambda x: x.item() if hasattr(x, "item") else str(x))
    if path == "-":
        print(text)
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text + "\n")
