"""GPU benchmark: sampler and train step for a ~0.5B-parameter Qwen2 shape, tokens/s and MFU.

    bash bench/gpu.sh            # or: python bench/gpu_bench.py --out results.json

MFU is model FLOPs per second over the chip's bf16 matmul peak, measured in the same run (8192^3 bf16 products with
fp32 accumulation). Model FLOPs: 6 * params * tokens (+ attention) for a train step, 2 * params per decoded token.
Random weights: speed does not depend on their values.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sage_jax import model, objectives, sampler, sharding, train_state  # noqa: E402


def timed(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile + warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def matmul_peak(n: int = 8192, repeats: int = 10) -> float:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    return 2 * n ** 3 / timed(lambda: f(a, b), repeats)


def train_flops_per_token(cfg: model.ModelConfig, seq: int) -> float:
    attn = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq  # QK^T and PV, fwd+bwd, causal not discounted
    return 6 * cfg.num_params + attn


def bench_train(cfg, rows: int, seq: int, completion: int, grad_accum: int, peak: float, repeats: int) -> dict:
    mesh = sharding.make_mesh((1, -1, 1))
    rules = dict(sharding.DEFAULT_RULES)
    with jax.set_mesh(mesh), sharding.use_rules(rules):
        params = jax.jit(lambda: model.init_params(cfg, jax.random.key(0)),
                         out_shardings=model.param_shardings(cfg, mesh, rules))()
        import ml_collections
        optim = ml_collections.ConfigDict(dict(lr=1e-6, schedule="constant", warmup_steps=0, weight_decay=0.01,
                                               grad_clip=1.0, b1=0.9, b2=0.999, eps=1e-8))
        tx, schedule = train_state.make_optimizer(optim, 100)
        state, shardings = train_state.create_state(params, tx, cfg, mesh, rules)
        loss_cfg = objectives.LossConfig(guide=objectives.guides.GuideConfig(name="branch"))
        step = train_state.make_train_step(cfg, loss_cfg, tx, schedule, 0, grad_accum, shardings)
        rng = np.random.default_rng(0)
        P = seq - completion
        batch = {"tokens": rng.integers(0, cfg.vocab_size, (rows, seq), dtype=np.int32),
                 "mask": np.ones((rows, seq), np.int32), "completion_mask": np.ones((rows, completion), np.float32),
                 "advantages": rng.standard_normal(rows).astype(np.float32),
                 "ref_logp": np.full((rows, completion), -2.0, np.float32),
                 "sampler_logp": np.zeros((rows, completion), np.float32), "truncated": np.zeros(rows, bool)}
        batch = {k: jax.device_put(v, sharding.data_sharding(mesh, v.ndim)) for k, v in batch.items()}
        batch["rl_step"] = np.int32(0)
        holder = {"state": state}

        def run():
            holder["state"], m = step(holder["state"], batch)
            return m
        seconds = timed(run, repeats)
    tokens = rows * seq
    flops = train_flops_per_token(cfg, seq) * tokens
    return {"bench": "train_step", "rows": rows, "seq": seq, "grad_accum": grad_accum, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "tflops": flops / seconds / 1e12, "mfu": flops / seconds / peak}


def bench_sampler(cfg, batch: int, prompt_len: int, new_tokens: int, num_samples: int, peak: float,
                  repeats: int) -> dict:
    params = jax.jit(lambda: model.init_params(cfg, jax.random.key(0)))()
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, (batch // num_samples, prompt_len)).tolist()
    fn = lambda: sampler.generate(cfg, params, prompts, max_new_tokens=new_tokens, temperature=1.0, eos_ids=(),
                                  num_samples=num_samples, seed=0).tokens
    seconds = timed(fn, repeats)
    tokens = batch * new_tokens
    flops = 2 * cfg.num_params * tokens
    return {"bench": "sampler", "batch": batch, "num_samples": num_samples, "prompt_len": prompt_len,
            "new_tokens": new_tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "tflops": flops / seconds / 1e12, "mfu": flops / seconds / peak,
            "programs_compiled": sampler.compile_count()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--out", default="gpu_bench.json")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (for a CPU smoke run)")
    args = ap.parse_args()
    results = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "rows": []}

    def record(row):
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    peak = matmul_peak(512 if args.quick else 8192, 2 if args.quick else 10)
    results["matmul_peak_tflops"] = peak / 1e12
    print(f"measured bf16 matmul peak: {peak / 1e12:.1f} TFLOP/s", flush=True)
    cfg = model.preset("tiny" if args.quick else args.preset, param_dtype="float32", compute_dtype="bfloat16",
                       remat=not args.quick, logits_chunk=256)
    results["params"] = cfg.num_params
    train_shapes = [(4, 128, 64, 1)] if args.quick else [(32, 1024, 768, 1), (64, 2048, 1536, 4)]
    for rows, seq, completion, accum in train_shapes:
        try:
            record(bench_train(cfg, rows, seq, completion, accum, peak, args.repeats))
        except Exception as e:  # keep going: one shape failing must not lose the others
            record({"bench": "train_step", "rows": rows, "seq": seq, "error": repr(e)[:500]})
    samp_shapes = [(8, 32, 16, 1)] if args.quick else [(64, 128, 512, 8), (256, 128, 512, 8), (1, 128, 256, 1)]
    for batch, prompt_len, new_tokens, g in samp_shapes:
        try:
            record(bench_sampler(cfg.replace(remat=False), batch, prompt_len, new_tokens, g, peak, args.repeats))
        except Exception as e:
            record({"bench": "sampler", "batch": batch, "error": repr(e)[:500]})


if __name__ == "__main__":
    main()
