"""LoRA figures for docs/PERFORMANCE.md.

    python -m sage_jax.bench lora memory [--devices 32]   # per-device bytes of the 7B configs, full FT vs LoRA
    python -m sage_jax.bench lora sampler [--repeats 9]   # rollouts on the small preset: base, unmerged, merged

`memory` counts persistent state from shapes (weights, Adam moments, reference), every tensor sharded over all
devices as the configs' fsdp x tensor mesh shards them; activations and gradients come on top in both cases (the
gradients of full fine-tuning are another fp32 copy of the weights, LoRA's are adapter-sized). `sampler` times
sampler.generate three ways, interleaved, and reports wall and process CPU seconds (CPU time is less disturbed by
other processes on a shared machine).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from sage_jax.run import config as config_lib
from sage_jax.models import build, lora, decoder as model
from sage_jax.sampling import sampler
from sage_jax.bench import common

GB = 1e9
CONFIGS = ("qwen7b_branch", "r1distill7b_branch", "qwen3_4b_branch")


def memory(args: argparse.Namespace) -> list[dict]:
    """A markdown row per 7B config: persistent bytes of full fine-tuning vs LoRA rank 8."""
    print("| config | model | full FT: weights + Adam + reference | LoRA: base + adapters + Adam | saving |")
    print("|---|---|---|---|---|")
    rows = []
    for name in CONFIGS:
        cfg, _ = build.resolve_model(config_lib.load(str(common.REPO / "configs" / f"{name}.py")))
        n, n_lora = cfg.num_params, lora.num_params(cfg, lora.LoraConfig(rank=8, alpha=16.0))
        full = n * (4 + 8 + 2)  # fp32 weights, fp32 Adam mu and nu, bf16 reference
        adapted = n * 2 + n_lora * (4 + 8)  # one bf16 base (also the reference), fp32 adapters and their moments
        per = lambda b: f"{b / GB:.1f} GB ({b / args.devices / GB:.2f} GB/device)"
        print(f"| {name} | {n / 1e9:.2f}B, LoRA {n_lora / 1e6:.1f}M | {per(full)} | {per(adapted)} | "
              f"{full / adapted:.1f}x |")
        rows.append(dict(config=name, params=n, lora_params=n_lora, full_bytes=full, lora_bytes=adapted,
                         devices=args.devices))
    return rows


def sampler_speed(args: argparse.Namespace) -> list[dict]:
    """Rollouts of --preset with the base weights, with adapters applied unmerged, and merged first."""
    cfg = model.preset(args.preset, compute_dtype="float32")
    base = model.init_params(cfg, jax.random.key(0))
    lcfg = lora.LoraConfig(rank=8, alpha=16.0)
    adapters = lora.init_adapters(cfg, lcfg, jax.random.key(1))
    adapters = {w: {"a": a["a"], "b": 0.01 * jax.random.normal(jax.random.key(2), a["b"].shape)}
                for w, a in adapters.items()}
    prompts = [list(np.random.RandomState(i).randint(3, cfg.vocab_size, 64)) for i in range(args.prompts)]
    merge = jax.jit(lambda b, a: lora.merge(cfg, lcfg, b, a))
    gen = lambda p: sampler.generate(cfg, p, prompts, max_new_tokens=args.new_tokens, temperature=1.0, seed=0,
                                     num_samples=args.group, eos_ids=(), pad_id=0).tokens
    fns = {"base": lambda: gen(base), "lora_unmerged": lambda: gen(lora.apply(base, adapters, lcfg)),
           "lora_merge_then_sample": lambda: gen(merge(base, adapters))}
    cpu: dict[str, list[float]] = {n: [] for n in fns}

    def with_cpu_time(name):
        def run():
            c = time.process_time()
            out = jax.block_until_ready(fns[name]())
            cpu[name].append(time.process_time() - c)
            return out
        return run
    wall = common.interleaved_seconds({n: with_cpu_time(n) for n in fns}, args.repeats)
    print(f"{args.preset} preset, {args.prompts} prompts x {args.group} samples, {args.new_tokens} new tokens, "
          f"median of {args.repeats}")
    rows = []
    for n in fns:
        runs_cpu = cpu[n][1:]  # the first call is the warm-up
        rows.append(dict(impl=n, wall_s=statistics.median(wall[n]), cpu_s=statistics.median(runs_cpu)))
        print(f"| {n} | {rows[-1]['wall_s']:.2f} s wall | {rows[-1]['cpu_s']:.2f} s CPU |")
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sage_jax.bench lora", description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=["lora"])
    p.add_argument("what", choices=["memory", "sampler"])
    p.add_argument("--devices", type=common.count(1), default=32, help="memory: devices the state is sharded over")
    p.add_argument("--preset", default="small", choices=["tiny", "small"], help="sampler: the model shape")
    p.add_argument("--repeats", type=common.count(1), default=9)
    p.add_argument("--prompts", type=common.count(1), default=4)
    p.add_argument("--group", type=common.count(1), default=8)
    p.add_argument("--new-tokens", type=common.count(1), default=64)
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the rows as JSON to PATH (no PATH: one line on stdout)")
    return p


def main(argv: list[str]) -> list[dict]:
    args = parser().parse_args(argv)
    rows = {"memory": memory, "sampler": sampler_speed}[args.what](args)
    if args.json:
        common.write_json(args.json, {f"lora_{args.what}": rows})
    return rows
