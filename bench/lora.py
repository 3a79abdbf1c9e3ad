"""LoRA figures for docs/PERFORMANCE.md.

    python bench/lora.py memory [--devices 32]      # per-device bytes of the 7B configs, full fine-tuning vs LoRA
    python bench/lora.py sampler [--repeats 9]      # rollouts on the small preset: base, adapters unmerged, merged

`memory` counts persistent state from shapes (weights, Adam moments, reference), every tensor sharded over all
devices as the configs' fsdp x tensor mesh shards them; activations and gradients come on top in both cases (the
gradients of full fine-tuning are another fp32 copy of the weights, LoRA's are adapter-sized). `sampler` times
sampler.generate three ways, interleaved, and reports wall and process CPU seconds (CPU time is less disturbed by
other processes on a shared machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GB = 1e9


def memory(args) -> None:
    from sage_jax import config as config_lib, lora, plan
    print("| config | model | full FT: weights + Adam + reference | LoRA: base + adapters + Adam | saving |")
    print("|---|---|---|---|---|")
    for name in ("qwen7b_branch", "r1distill7b_branch", "qwen3_4b_branch"):
        config = config_lib.load(f"configs/{name}.py")
        cfg, _ = plan.resolve_model(config)
        lcfg = lora.LoraConfig(rank=8, alpha=16.0)
        n, n_lora = cfg.num_params, lora.num_params(cfg, lcfg)
        full = n * (4 + 8 + 2)  # fp32 weights, fp32 Adam mu and nu, bf16 reference
        adapted = n * 2 + n_lora * (4 + 8)  # one bf16 base (also the reference), fp32 adapters and their moments
        per = lambda b: f"{b / GB:.1f} GB ({b / args.devices / GB:.2f} GB/device)"
        print(f"| {name} | {n / 1e9:.2f}B, LoRA {n_lora / 1e6:.1f}M | {per(full)} | {per(adapted)} | "
              f"{full / adapted:.1f}x |")


def sampler(args) -> None:
    import jax
    import numpy as np
    from sage_jax import lora, model, sampler as sampler_lib

    cfg = model.preset("small", compute_dtype="float32")
    base = model.init_params(cfg, jax.random.key(0))
    lcfg = lora.LoraConfig(rank=8, alpha=16.0)
    adapters = lora.init_adapters(cfg, lcfg, jax.random.key(1))
    adapters = {w: {"a": a["a"], "b": 0.01 * jax.random.normal(jax.random.key(2), a["b"].shape)}
                for w, a in adapters.items()}
    prompts = [list(np.random.RandomState(i).randint(3, cfg.vocab_size, 64)) for i in range(args.prompts)]
    merge = jax.jit(lambda b, a: lora.merge(cfg, lcfg, b, a))
    gen = lambda p: sampler_lib.generate(cfg, p, prompts, max_new_tokens=args.new_tokens, temperature=1.0, seed=0,
                                         num_samples=args.group, eos_ids=(), pad_id=0).tokens
    fns = {"base": lambda: gen(base), "lora_unmerged": lambda: gen(lora.apply(base, adapters, lcfg)),
           "lora_merge_then_sample": lambda: gen(merge(base, adapters))}
    for fn in fns.values():
        jax.block_until_ready(fn())
    names = list(fns)
    wall, cpu = {n: [] for n in names}, {n: [] for n in names}
    for r in range(args.repeats):
        for n in names[r % len(names):] + names[:r % len(names)]:
            t, c = time.perf_counter(), time.process_time()
            jax.block_until_ready(fns[n]())
            wall[n].append(time.perf_counter() - t)
            cpu[n].append(time.process_time() - c)
    print(f"small preset, {args.prompts} prompts x {args.group} samples, {args.new_tokens} new tokens, "
          f"median of {args.repeats}")
    for n in names:
        print(f"| {n} | {statistics.median(wall[n]):.2f} s wall | {statistics.median(cpu[n]):.2f} s CPU |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["memory", "sampler"])
    p.add_argument("--devices", type=int, default=32)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    args = p.parse_args()
    {"memory": memory, "sampler": sampler}[args.mode](args)


if __name__ == "__main__":
    main()
