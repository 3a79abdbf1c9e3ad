"""The jitted train step (train_state.make_train_step, SAGE loss, AdamW) against the matmul peak; its ablations; the
matmul peak itself; XLA flag sets, each in a fresh process."""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import time

import jax
import numpy as np

from sage_jax.models import decoder as model
from sage_jax.rl import objectives
from sage_jax.training import state as train_state
from sage_jax.bench import common, flops
from sage_jax.bench.common import DTYPES, OPTIM, SAGE_LOSS, print_table

ABLATIONS = {  # variant -> ModelConfig overrides; "rows" scales the batch instead
    "default": {}, "remat": {"remat": True}, "no_scan": {"scan_layers": False}, "chunk_128": {"logits_chunk": 128},
    "chunk_2048": {"logits_chunk": 2048}, "bf16_compute": {"compute_dtype": "bfloat16"}, "rows_x0.25": {"rows": 0.25},
    "rows_x0.5": {"rows": 0.5},
}
FLAG_SETS = {"default": "", "onednn": "--xla_cpu_use_onednn=true", "xnnpack": "--xla_cpu_use_xnnpack=true",
             "eigen_1_thread": "--xla_cpu_multi_thread_eigen=false"}


def random_loss_batch(cfg: model.ModelConfig, rows: int, prompt_len: int, completion_len: int, seed: int = 0,
                      rl_step: int = 0) -> dict[str, np.ndarray]:
    """A loss batch (objectives.loss_fn layout) of random full-length rows."""
    rng = np.random.default_rng(seed)
    T = prompt_len + completion_len
    near_uniform = lambda: (-np.log(cfg.vocab_size) + 0.1 * rng.standard_normal((rows, completion_len))).astype(
        np.float32)
    return {"tokens": rng.integers(1, cfg.vocab_size, (rows, T)).astype(np.int32),
            "mask": np.ones((rows, T), np.int32), "completion_mask": np.ones((rows, completion_len), np.float32),
            "advantages": rng.standard_normal(rows).astype(np.float32), "ref_logp": near_uniform(),
            "sampler_logp": near_uniform(), "truncated": np.ones(rows, np.bool_), "rl_step": np.int32(rl_step)}


def lowered_train_step(cfg: model.ModelConfig, loss_cfg: objectives.LossConfig, rows: int, prompt_len: int,
                       completion_len: int, seed: int = 0):
    """(tx, train_state.make_train_step lowered for these shapes); nothing is allocated."""
    tx, schedule = train_state.make_optimizer(OPTIM, 1000)
    abstract = jax.eval_shape(lambda: train_state.init_state(model.init_params(cfg, jax.random.key(seed)), tx))
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype),
                         random_loss_batch(cfg, rows, prompt_len, completion_len))
    return tx, train_state.make_train_step(cfg, loss_cfg, tx, schedule, seed).lower(abstract, batch)


@functools.lru_cache(maxsize=32)
def compiled_train_step(cfg: model.ModelConfig, loss_cfg: objectives.LossConfig, rows: int, prompt_len: int,
                        completion_len: int, seed: int = 0):
    """(tx, compiled train step); cached so modes (and tests) with the same shapes share one compilation."""
    tx, lowered = lowered_train_step(cfg, loss_cfg, rows, prompt_len, completion_len, seed)
    return tx, lowered.compile()


def train_runner(cfg: model.ModelConfig, rows: int, prompt_len: int, completion_len: int, seed: int = 0,
                 params=None, loss_cfg: objectives.LossConfig = SAGE_LOSS):
    """(run, compiled): run(batch=None) does one donated train step (on a fixed random batch by default) and
    returns its metrics."""
    tx, compiled = compiled_train_step(cfg, loss_cfg, rows, prompt_len, completion_len, seed)
    params = common.init_params(cfg, seed) if params is None else params
    box = {"state": train_state.init_state(params, tx)}
    fixed = jax.device_put(random_loss_batch(cfg, rows, prompt_len, completion_len, seed))

    def run(batch=None):
        box["state"], metrics = compiled(box["state"], fixed if batch is None else batch)
        return metrics
    return run, compiled


def bench_train_step(preset: str = "tiny", dtype: str = "fp32", rows: int = 64, prompt_len: int = 32,
                     completion_len: int = 128, repeats: int = 3, variants: dict[str, dict] | None = None,
                     peak_size: int = 2048, seed: int = 0) -> list[dict]:
    """Tokens/s and FLOP/s of the train step per variant, against the matmul peak timed in the same loop."""
    variants = variants or {"default": {}}
    peak_fn, peak_flops = common.matmul_peak_fn(dtype, peak_size)
    fns, info = {"matmul_peak": peak_fn}, {}
    for name, overrides in variants.items():
        overrides = dict(overrides)
        n = max(1, int(rows * overrides.pop("rows", 1)))
        cfg = common.preset_config(preset, dtype, **overrides)
        start = time.perf_counter()
        fns[name], compiled = train_runner(cfg, n, prompt_len, completion_len, seed)
        info[name] = dict(rows=n, flops=flops.train_flops(cfg, n, prompt_len, completion_len),
                          compile_s=time.perf_counter() - start, xla_gflops=flops.xla_flops(compiled) / 1e9)
    times = common.interleaved_seconds(fns, repeats)
    peak = peak_flops / statistics.median(times["matmul_peak"])
    out = []
    for name, v in info.items():
        s = statistics.median(times[name])
        out.append(dict(preset=preset, dtype=dtype, variant=name, rows=v["rows"], seq=prompt_len + completion_len,
                        seconds=s, tokens_per_s=v["rows"] * (prompt_len + completion_len) / s,
                        model_gflops=v["flops"] / 1e9, gflops_per_s=v["flops"] / s / 1e9, peak_gflops_per_s=peak / 1e9,
                        frac_of_peak=v["flops"] / s / peak, compile_s=v["compile_s"], xla_gflops=v["xla_gflops"],
                        runs_s=times[name], peak_runs_s=times["matmul_peak"]))
    print_table(out, [("preset", ""), ("dtype", ""), ("variant", ""), ("rows", "d"), ("seq", "d"), ("seconds", ".3f"),
                      ("tokens_per_s", ".0f"), ("gflops_per_s", ".1f"), ("peak_gflops_per_s", ".1f"),
                      ("frac_of_peak", ".2f"), ("compile_s", ".1f")])
    return out


def train_step_mode(args) -> list[dict]:
    variants = ABLATIONS if args.ablate else None
    return [r for p in common.presets(args.preset) for r in bench_train_step(
        p, args.dtype, args.batch, args.prompt_len, args.new_tokens, args.repeats, variants)]


def bench_matmul(dtypes=("fp32", "bf16"), sizes=(1024, 2048), repeats: int = 3) -> list[dict]:
    """GFLOP/s of jitted square matmuls: the peak the train step is measured against."""
    fns = {(d, n): common.matmul_peak_fn(d, n) for d in dtypes for n in sizes}
    times = common.interleaved_seconds({k: f for k, (f, _) in fns.items()}, repeats)
    out = [dict(dtype=d, size=n, seconds=statistics.median(times[(d, n)]),
                gflops_per_s=fns[(d, n)][1] / statistics.median(times[(d, n)]) / 1e9) for d, n in fns]
    print_table(out, [("dtype", ""), ("size", "d"), ("seconds", ".3f"), ("gflops_per_s", ".1f")])
    return out


def matmul_mode(args) -> list[dict]:
    return bench_matmul(tuple(DTYPES), tuple(int(n) for n in str(args.sizes).split(",")), args.repeats)


def bench_flags(flag_sets: dict[str, str] | None = None, mode: str = "train_step", mode_args: tuple[str, ...] = (),
                metric: str = "tokens_per_s", rounds: int = 2) -> list[dict]:
    """`python -m sage_jax.bench <mode> <mode_args>` under each XLA_FLAGS set, each run a fresh process (XLA reads
    its flags once); rounds interleave the sets. A row per (set, row of the mode): numbers are medians over rounds,
    `speedup` is `metric` over the first set's."""
    flag_sets = flag_sets or FLAG_SETS
    root = str(common.REPO)
    cmd = [sys.executable, "-m", "sage_jax.bench", mode, "--json", *mode_args]
    runs: dict[str, list[list[dict]]] = {name: [] for name in flag_sets}
    for _ in range(rounds):
        for name, flag in flag_sets.items():
            env = dict(os.environ, XLA_FLAGS=" ".join(f for f in (os.environ.get("XLA_FLAGS", ""), flag) if f),
                       PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p))
            proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(f"{' '.join(cmd[1:])} under XLA_FLAGS={flag!r} failed:\n{proc.stderr[-3000:]}")
            runs[name].append(json.loads(proc.stdout.strip().splitlines()[-1])["modes"][mode])
    out = []
    for name, per_round in runs.items():
        for i, template in enumerate(per_round[0]):
            row = {k: (statistics.median(r[i][k] for r in per_round) if isinstance(v, float) else v)
                   for k, v in template.items() if not isinstance(v, list)}
            out.append(dict(flags=name, xla_flags=flag_sets[name], **row))
    first = out[:len(runs[next(iter(runs))][0])]
    for j, r in enumerate(out):
        r["speedup"] = r[metric] / first[j % len(first)][metric]
    print_table(out, [("flags", ""), *[(k, ".3g" if isinstance(v, float) else "") for k, v in out[0].items()
                                       if k not in ("flags", "xla_flags", "speedup")], ("speedup", ".2f")])
    return out


def flags_mode(args) -> list[dict]:
    """Flag sets on the train step (the preset, dtype and shapes given) and on the matmul peak."""
    step_args = ("--preset", args.preset, "--dtype", args.dtype, "--batch", str(args.batch), "--prompt-len",
                 str(args.prompt_len), "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats))
    return (bench_flags(None, "matmul", ("--repeats", str(args.repeats)), "gflops_per_s")
            + bench_flags(None, "train_step", step_args, "tokens_per_s"))
