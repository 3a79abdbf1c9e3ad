"""Benchmarks, one function per mode.

  python -m sage_jax.bench sampler --preset both --dtype fp32 --batch 64
  python -m sage_jax.bench all

`sampler`: this sampler's tokens/s against transformers' `generate` (torch, CPU) on the same random weights, batch,
prompt length and forced number of new tokens (greedy, EOS ignored). Warm-up runs are excluded; each number is the
median of `--repeats` runs, ours and theirs interleaved (bench_train.interleaved_seconds) so load from other processes
hits both alike. A third program in the same loop, `matmuls_only` (decode_matmuls_fn), does only the model's matmuls
for as many decode steps: its FLOP/s is the peak the table's `frac_of_peak` refers to, and its tokens/s the ceiling
for a sampler built on XLA's matmuls here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from typing import Callable

import jax
import numpy as np

from sage_jax import bench_train
from sage_jax.bench_train import DTYPES, interleaved_seconds

MODES: dict[str, Callable[[argparse.Namespace], list[dict]]] = {}
MATMULS_ONLY = "matmuls_only"  # the sampler table's ceiling row: see decode_matmuls_fn


def register(name: str):
    def wrap(fn):
        MODES[name] = fn
        return fn
    return wrap


# --------------------------------------------------------------------------------------------------- sampler

def _hf_generate_fn(model_dir: str, dtype: str, prompts_BxT: np.ndarray, new_tokens: int,
                    threads: int | None = None) -> Callable[[], None]:
    import torch
    import transformers

    torch.set_num_threads(threads or os.cpu_count() or 1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, DTYPES[dtype])).eval()
    ids = torch.as_tensor(prompts_BxT, dtype=torch.long)
    mask = torch.ones_like(ids)

    def run():
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None)
        assert out.shape[1] == prompts_BxT.shape[1] + new_tokens
    return run


def _sage_generate_fn(cfg, params, prompts_BxT: np.ndarray, new_tokens: int) -> Callable[[], None]:
    from sage_jax import sampler
    prompts = prompts_BxT.tolist()

    def run():
        out = sampler.generate(cfg, params, prompts, max_new_tokens=new_tokens, temperature=0.0, eos_ids=())
        jax.block_until_ready(out)
    return run


def decode_matmuls_fn(cfg, params, rows: int, steps: int) -> tuple[Callable[[], jax.Array], float]:
    """(fn, flops): `steps` decode steps of `rows` rows that do nothing but the model's matmuls (q, k, v, o, gate, up,
    down per layer and the unembedding, same weights and shapes) chained through one [rows, D] state: the time a
    decode step cannot go below with XLA's matmuls on this machine (no attention, sampling or cache)."""
    import jax.numpy as jnp

    from sage_jax import model
    dt = jnp.dtype(cfg.compute_dtype)
    D, reps = cfg.hidden_size, cfg.num_heads // cfg.num_kv_heads
    names = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    layers = [{k: lp[k].astype(dt).reshape(-1, lp[k].shape[-1]) if k in ("wo", "w_down")
               else lp[k].astype(dt).reshape(D, -1) for k in names}
              for lp in model.unstack_layers(cfg, params)["layers"]]

    @jax.jit
    def program(layers, params, x_NxD):
        w_DxV = model.unembed_matrix(cfg, params)

        def step(_, x):
            for lp in layers:
                x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)  # keeps x finite
                kv = (x @ lp["wk"]) * (x @ lp["wv"])
                x = x + (x @ lp["wq"] + jnp.tile(kv, (1, reps))) @ lp["wo"]
                x = x + (jax.nn.silu(x @ lp["w_gate"]) * (x @ lp["w_up"])) @ lp["w_down"]
            logits = jnp.dot(x, w_DxV, preferred_element_type=jnp.float32)
            return x + 1e-3 * jnp.max(logits, axis=-1, keepdims=True).astype(x.dtype)  # uses every logit
        return jax.lax.fori_loop(0, steps, step, x_NxD)

    x = jax.random.normal(jax.random.key(0), (rows, D), dt)
    layer_matmuls = sum(int(np.prod(lp[k].shape)) for lp in layers for k in names)
    flops = 2.0 * rows * steps * (layer_matmuls + D * cfg.vocab_size)
    return (lambda: program(layers, params, x)), flops


def bench_sampler(presets=("tiny", "small"), dtype: str = "fp32", batch: int = 64, prompt_len: int = 32,
                  new_tokens: int = 128, repeats: int = 3, latency: bool = True, seed: int = 0,
                  hf_threads: int | None = None) -> list[dict]:
    """Rows of {preset, batch, impl, tokens_per_s, seconds}; also prints a table with the ratios last."""
    from sage_jax import model, sampler

    rows = []
    load_before = os.getloadavg()[0]
    for name in presets:
        cfg = model.preset(name, param_dtype=DTYPES[dtype], compute_dtype=DTYPES[dtype], eos_token_ids=())
        params = jax.jit(model.init_params, static_argnums=0)(cfg, jax.random.key(seed))
        rng = np.random.default_rng(seed)
        with tempfile.TemporaryDirectory() as tmp:
            model.save_hf(tmp, cfg, params)
            for b in ([batch, 1] if latency and batch != 1 else [batch]):
                prompts = rng.integers(1, cfg.vocab_size, (b, prompt_len))
                floor_fn, floor_flops = decode_matmuls_fn(cfg, params, b, new_tokens)
                fns = {"sage_jax": _sage_generate_fn(cfg, params, prompts, new_tokens),
                       "transformers": _hf_generate_fn(tmp, dtype, prompts, new_tokens, hf_threads),
                       MATMULS_ONLY: floor_fn}
                compiled_before = sampler.compile_count()
                seconds = {k: statistics.median(t) for k, t in interleaved_seconds(fns, repeats).items()}
                peak = floor_flops / seconds[MATMULS_ONLY]
                flops = bench_train.decode_flops(cfg, b, 1, prompt_len, new_tokens)
                for impl, s in seconds.items():
                    f = floor_flops if impl == MATMULS_ONLY else flops
                    rows.append(dict(preset=name, dtype=dtype, batch=b, prompt_len=prompt_len, new_tokens=new_tokens,
                                     impl=impl, seconds=s, tokens_per_s=b * new_tokens / s,
                                     ms_per_step=1e3 * s / new_tokens, model_gflops=f / 1e9,
                                     gflops_per_s=f / s / 1e9, frac_of_peak=f / s / peak))
                rows[-3]["programs_compiled"] = sampler.compile_count() - compiled_before
    _print_sampler_table(rows)
    print(f"sampler programs compiled in this run: {sampler.compile_count()}; 1-min load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after ({os.cpu_count()} cores)")
    return rows


def _print_sampler_table(rows: list[dict]) -> None:
    print()
    bench_train.print_table(rows, [("preset", ""), ("dtype", ""), ("batch", "d"), ("impl", ""), ("tokens_per_s", ".1f"),
                                   ("ms_per_step", ".2f"), ("seconds", ".3f"), ("gflops_per_s", ".1f"),
                                   ("frac_of_peak", ".2f")])
    print(f"(model FLOPs as sage_jax computes them; peak = the '{MATMULS_ONLY}' row: the same weights' matmuls and "
          "nothing else, timed in the same loop)")
    print("\nratio sage_jax / transformers tokens/s (and the matmuls-only ceiling / transformers):")
    by_key: dict[tuple, dict[str, float]] = {}
    for r in rows:
        by_key.setdefault((r["preset"], r["dtype"], r["batch"]), {})[r["impl"]] = r["tokens_per_s"]
    for (preset, dtype, batch), v in by_key.items():
        print(f"  {preset:8} {dtype:5} batch {batch:>3}: {v['sage_jax'] / v['transformers']:.2f}x "
              f"(ceiling {v[MATMULS_ONLY] / v['transformers']:.2f}x)")


@register("sampler")
def _sampler_mode(args: argparse.Namespace) -> list[dict]:
    presets = ("tiny", "small") if args.preset == "both" else (args.preset,)
    return bench_sampler(presets, args.dtype, args.batch, args.prompt_len, args.new_tokens, args.repeats,
                         hf_threads=args.hf_threads)


# --------------------------------------------------------------------------------------------------- entry point

def main(argv: list[str] | None = None) -> None:
    import sys
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in bench_train.MODES:  # train_step, rl_step, memory, scaling, matmul, flags
        bench_train.main(argv)
        return
    parser = argparse.ArgumentParser(prog="python -m sage_jax.bench", description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=[*MODES, *bench_train.MODES, "all"])
    parser.add_argument("--preset", default="both", choices=["tiny", "small", "both"])
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hf-threads", type=int, default=None, help="torch threads (default: all cores)")
    args = parser.parse_args(argv)
    for mode in (MODES if args.mode == "all" else [args.mode]):
        print(f"== {mode}")
        MODES[mode](args)
    if args.mode == "all":  # the training-side modes with the same shapes
        shared = ["--preset", args.preset, "--dtype", args.dtype, "--batch", str(args.batch), "--prompt-len",
                  str(args.prompt_len), "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
        for mode in ("matmul", "train_step", "rl_step", "memory", "scaling"):
            print(f"== {mode}")
            bench_train.main([mode, *shared])


if __name__ == "__main__":
    main()
