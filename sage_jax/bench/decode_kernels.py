"""Where a long-tail decode step's time goes on XLA:CPU, measured in one run (issue 26; docs/PERFORMANCE.md).

    python -m sage_jax.bench decode_kernels [--repeats 3]

1. The slot pool against a static batch of the same width: W prompts, one row of 512 tokens each (a static batch of
   W rows), and the same W prompts with 64 / W samples each, 64 rows whose other samples stop at their first token
   (one pool of 64 slots that shrinks to W at once; both prefill the same W prompts). Equal times mean the pool's
   loop adds nothing beyond the width it computes.
2. The decode matmuls at few rows: XLA's `x @ W` against torch's on the same machine and thread count, through the
   small preset's own weights (every layer's gate and down matrices, 512 x 1536 fp32), each output used whole.
3. The decode attention (8 layers at position 450, the sampler's stacked cache) as shipped, and with other block
   sizes (kv_cache.DECODE_BLOCK) or none (the whole cache in one pass).
Every figure is a median of --repeats timed runs after a warm-up; the variants of each part alternate.
"""
from __future__ import annotations

import argparse
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from sage_jax.bench import common
from sage_jax.bench import sampler as sampler_bench
from sage_jax.models import kv_cache
from sage_jax.sampling import sampler as sampler_lib


def median_ms(fns: dict, repeats: int) -> dict:
    return {k: 1e3 * statistics.median(v) for k, v in common.interleaved_seconds(fns, repeats).items()}


def pool_vs_static(cfg, params, widths, repeats: int) -> None:
    for w in widths:
        prompts = np.random.default_rng(w).integers(1, cfg.vocab_size, (w, 32)).tolist()
        lengths = [512 if i % (64 // w) == 0 else 1 for i in range(64)]  # the first sample of each prompt runs on

        def static(w=w, prompts=prompts):
            return sampler_lib.generate(cfg, params, prompts, max_new_tokens=512, temperature=0.0, eos_ids=(),
                                        row_max_new_tokens=[512] * w).lengths

        def pool(prompts=prompts, lengths=lengths):  # the same W prompts prefilled, 64 / W samples of each
            return sampler_lib.generate(cfg, params, prompts, max_new_tokens=512, temperature=0.0, eos_ids=(),
                                        num_samples=64 // w, row_max_new_tokens=lengths).lengths
        ms = median_ms({"static": static, "pool": pool}, repeats)
        print(f"[1] W = {w:2d}, 512 tokens: static batch {ms['static'] / 1e3:.2f} s, pool of 64 slots "
              f"{ms['pool'] / 1e3:.2f} s: pool / static {ms['pool'] / ms['static']:.3f}", flush=True)


def matmuls(pairs, rows_list, repeats: int, sweeps: int = 8) -> None:
    """x through every layer's (w_gate [D, F], w_down [F, D]) pair, `sweeps` times: the weights stream from memory
    as in a decode step (the model's own arrays, each used whole), on XLA and on torch."""
    import torch  # the peer, only for this part
    D = pairs[0][0].shape[0]
    jax_pairs = [tuple(jnp.asarray(w) for w in p) for p in pairs]
    torch_pairs = [tuple(torch.from_numpy(w.copy()) for w in p) for p in pairs]

    @jax.jit
    def xla(x, ps):
        def sweep(_, x):
            for up, down in ps:
                x = x + 1e-3 * ((x @ up) @ down)
            return x
        return jax.lax.fori_loop(0, sweeps, sweep, x)

    def torch_sweeps(x):
        with torch.no_grad():
            for _ in range(sweeps):
                for up, down in torch_pairs:
                    x = x + 1e-3 * ((x @ up) @ down)
        return x
    n = sweeps * 2 * len(pairs)
    mb = pairs[0][0].nbytes / 1e6
    for rows in rows_list:
        x = np.random.default_rng(rows).standard_normal((rows, D), dtype=np.float32)
        xj, xt = jnp.asarray(x), torch.from_numpy(x)
        ms = median_ms({"xla": lambda: xla(xj, jax_pairs).block_until_ready(), "torch": lambda: torch_sweeps(xt)},
                       repeats)
        us = {k: 1e3 * v / n for k, v in ms.items()}
        print(f"[2] {rows:2d} rows, {len(pairs)} layers' gate and down ({mb:.1f} MB each): XLA {us['xla']:.0f} us "
              f"({mb / us['xla'] * 1e3:.1f} GB/s), torch {us['torch']:.0f} us ({mb / us['torch'] * 1e3:.1f} GB/s) "
              f"per matmul: XLA / torch {us['xla'] / us['torch']:.2f}", flush=True)


def attention(cfg, rows_list, repeats: int, position: int = 450, blocks=(64, 128, 256, None)) -> None:
    L, K, H, N = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads
    S = 32 + 512
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.standard_normal((64, L, K, S, H), dtype=np.float32)) for _ in range(2))
    shipped = kv_cache.DECODE_BLOCK
    for rows in rows_list:
        q = jnp.asarray(rng.standard_normal((rows, 1, N, H), dtype=np.float32))
        allowed = jnp.asarray(np.arange(S)[None, None, :] < position).repeat(rows, 0)
        fns = {}
        try:
            for blk in blocks:
                kv_cache.DECODE_BLOCK = blk or S  # None: one pass over the whole cache (no blocks)
                f = jax.jit(lambda q, k, v, a: sum(kv_cache.cached_attention(q, k, v, a, layer=i) for i in range(L)))
                fns[blk or "none"] = f.lower(q, k, v, allowed).compile()  # traced under this block size
        finally:
            kv_cache.DECODE_BLOCK = shipped
        ms = median_ms({b: (lambda f=f: f(q, k, v, allowed).block_until_ready()) for b, f in fns.items()}, repeats)
        mb = 2 * rows * L * K * position * H * 4 / 1e6
        print(f"[3] {rows:2d} rows, position {position}, {L} layers ({mb:.0f} MB of cache read): "
              + ", ".join(f"block {b}: {t:.2f} ms ({mb / t:.1f} GB/s)" for b, t in ms.items()), flush=True)


def main(argv: list[str]) -> list[dict]:
    """argv: ["decode_kernels", flags...]. Prints its three parts as it goes; returns no table rows."""
    import torch
    parser = argparse.ArgumentParser(prog="python -m sage_jax.bench decode_kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=common.count(1), default=3)
    args = parser.parse_args(argv[1:])
    print(f"torch threads {torch.get_num_threads()}, {os.cpu_count()} cores, jax {jax.__version__}", flush=True)
    for _, cfg, params, _ in sampler_bench._models(("small",), "fp32", 0, None):
        pool_vs_static(cfg, params, (4, 16), args.repeats)
        layers = params["layers"]
        D = cfg.hidden_size
        pairs = [(np.asarray(layers["w_gate"][i], np.float32).reshape(D, -1),
                  np.asarray(layers["w_down"][i], np.float32).reshape(-1, D)) for i in range(cfg.num_layers)]
        matmuls(pairs, (1, 4, 16, 64), args.repeats)
        attention(cfg, (4, 16, 64), args.repeats)
    print(f"1-min load average {os.getloadavg()[0]:.1f}")
    return []
