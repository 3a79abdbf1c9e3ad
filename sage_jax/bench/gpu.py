"""Accelerator benchmark: the sampler and the sharded train step of a ~0.5B-parameter Qwen2 shape, tokens/s and MFU.

    python -m sage_jax.bench gpu --out results.json     # on a GPU or TPU host
    python -m sage_jax.bench gpu --quick --out /tmp/gpu.json   # tiny shapes: a smoke run on any machine
    python -m sage_jax.bench gpu --decode-blocks 64,256,640,0   # + the sampler with the decode attention in blocks

MFU is model FLOPs per second (flops.py, the count every mode uses) over the chip's bf16 matmul peak, measured in
the same run (8192^3 bf16 products with fp32 accumulation). Random weights: speed does not depend on their values.
Each shape is timed as every mode times (common.interleaved_seconds: a warm-up call, then the median of --repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import jax
import numpy as np

from sage_jax.models import decoder as model, sharding
from sage_jax.sampling import sampler
from sage_jax.training import state as train_state
from sage_jax.bench import common, flops
from sage_jax.bench.common import OPTIM, SAGE_LOSS
from sage_jax.bench.train_step import random_loss_batch


def _median_seconds(fn, repeats: int) -> float:
    return statistics.median(common.interleaved_seconds({"fn": fn}, repeats)["fn"])


def matmul_peak(size: int, repeats: int) -> float:
    """FLOP/s of one jitted bf16 [size, size] matmul with fp32 accumulation."""
    fn, peak_flops = common.matmul_peak_fn("bf16", size, calls=1)
    return peak_flops / _median_seconds(fn, repeats)


def bench_train(cfg: model.ModelConfig, rows: int, seq: int, completion: int, grad_accum: int, peak: float,
                repeats: int) -> dict:
    """One donated train step (SAGE loss, the base optimizer) on a random batch, params sharded over every device."""
    mesh = sharding.make_mesh((1, -1, 1))
    rules = dict(sharding.DEFAULT_RULES)
    with jax.set_mesh(mesh), sharding.use_rules(rules):
        params = jax.jit(lambda: model.init_params(cfg, jax.random.key(0)),
                         out_shardings=model.param_shardings(cfg, mesh, rules))()
        tx, schedule = train_state.make_optimizer(OPTIM, 100)
        state, shardings = train_state.create_state(params, tx, cfg, mesh, rules)
        step = train_state.make_train_step(cfg, SAGE_LOSS, tx, schedule, 0, grad_accum, shardings)
        batch = random_loss_batch(cfg, rows, seq - completion, completion)
        batch = {k: v if k == "rl_step" else jax.device_put(v, sharding.data_sharding(mesh, v.ndim))
                 for k, v in batch.items()}
        box = {"state": state}

        def run():
            box["state"], metrics = step(box["state"], batch)
            return metrics
        seconds = _median_seconds(run, repeats)
    model_flops = flops.train_flops(cfg, rows, seq - completion, completion)
    return {"bench": "train_step", "rows": rows, "seq": seq, "grad_accum": grad_accum, "seconds": seconds,
            "tokens_per_s": rows * seq / seconds, "tflops": model_flops / seconds / 1e12,
            "mfu": model_flops / seconds / peak}


def bench_sampler(cfg: model.ModelConfig, batch: int, prompt_len: int, new_tokens: int, num_samples: int,
                  peak: float, repeats: int, attention: str = "auto") -> dict:
    """sampler.generate of batch rows (batch / num_samples prompts), every row to new_tokens (EOS ignored), the
    decode attention in form `attention` (models.decode_forms)."""
    params = common.init_params(cfg)
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch // num_samples, prompt_len)).tolist()
    fn = lambda: sampler.generate(cfg, params, prompts, max_new_tokens=new_tokens, temperature=1.0, eos_ids=(),
                                  num_samples=num_samples, seed=0, decode_attention=attention).tokens
    seconds = _median_seconds(fn, repeats)
    model_flops = flops.decode_flops(cfg, batch // num_samples, num_samples, prompt_len, new_tokens)
    return {"bench": "sampler", "batch": batch, "num_samples": num_samples, "prompt_len": prompt_len,
            "new_tokens": new_tokens, "seconds": seconds, "tokens_per_s": batch * new_tokens / seconds,
            "tflops": model_flops / seconds / 1e12, "mfu": model_flops / seconds / peak,
            "programs_compiled": sampler.compile_count()}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sage_jax.bench gpu", description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=["gpu"])
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--out", default="gpu_bench.json")
    p.add_argument("--repeats", type=common.count(1), default=3)
    p.add_argument("--quick", action="store_true", help="tiny shapes (for a CPU smoke run)")
    p.add_argument("--decode-blocks", default="", help="also time the sampler shapes with the decode attention in "
                   "blocks of these many cache slots (0: one pass), e.g. 64,256,640,0")
    return p


def main(argv: list[str]) -> list[dict]:
    """Rows of every shape (a failed shape records its error and the others still run), rewritten to --out after
    each."""
    args = parser().parse_args(argv)
    # the GPU allocator's share of memory (read when the backend starts, on the first device call below)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
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
    train_shapes = [(8, 128, 64, 1)] if args.quick else [(32, 1024, 768, 1), (64, 2048, 1536, 4)]
    for rows, seq, completion, accum in train_shapes:
        try:
            record(bench_train(cfg, rows, seq, completion, accum, peak, args.repeats))
        except Exception as e:  # noqa: BLE001 - one shape failing (e.g. out of memory) must not lose the others
            record({"bench": "train_step", "rows": rows, "seq": seq, "error": repr(e)[:500]})
    samp_shapes = [(8, 32, 16, 1)] if args.quick else [(64, 128, 512, 8), (256, 128, 512, 8), (1, 128, 256, 1)]
    for batch, prompt_len, new_tokens, g in samp_shapes:
        try:
            record(bench_sampler(cfg.replace(remat=False), batch, prompt_len, new_tokens, g, peak, args.repeats))
        except Exception as e:  # noqa: BLE001
            record({"bench": "sampler", "batch": batch, "error": repr(e)[:500]})
    for blk in [int(b) for b in args.decode_blocks.split(",") if b]:
        for row in decode_block_rows(cfg.replace(remat=False), samp_shapes, blk, peak, args.repeats):
            record(row)
    return results["rows"]


def decode_block_rows(cfg, shapes, blk: int, peak: float, repeats: int) -> list[dict]:
    """The sampler shapes with the decode attention forced into blocks of `blk` slots (0: one pass), on any
    platform; the sampler's programs are retraced under it and the shipped block size is restored after."""
    from sage_jax.models import kv_cache
    shipped = kv_cache.DECODE_BLOCK
    rows = []
    try:
        kv_cache.DECODE_BLOCK = blk or shipped
        jax.clear_caches()
        for batch, prompt_len, new_tokens, g in shapes:
            rows.append(bench_sampler(cfg, batch, prompt_len, new_tokens, g, peak, repeats,
                                      "blocked" if blk else "one_pass") | {"decode_block": blk})
    finally:
        kv_cache.DECODE_BLOCK = shipped
        jax.clear_caches()
    return rows
