"""What the decode pool (decode_pool.py) starts from and its shape: each sequence prefilled once (its prompt, then the
tokens a resumed row carries in), per-row gathers within data-parallel blocks, how many queues and decode slots it
keeps, and the widths it shrinks through."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from sage_jax.models import kv_cache
from sage_jax.models import decoder as model_lib
from sage_jax.models.decode_forms import DecodeForms
from sage_jax.models.decoder import ModelConfig, Params


# Completions shorter than this take only halving widths: on CPU a width's decode loop body compiles in about the
# time of 100-400 of its steps (about 4 s for the small preset, 2 s for the demo's model), so finer widths pay back
# only over long completions (the CPU demo's 24 tokens: 4 min 26 s wall with 21 widths per sampler program).
FINE_WIDTHS_MIN_TOKENS = 128


def stage_widths(slots: int, dp: int, new_tokens: int | None = None) -> tuple[int, ...]:
    """The pool's widths, largest first, counted in slots per data-parallel shard (dp = data x fsdp), down to 2 per
    shard or S/32, whichever is more (with one slot per shard XLA:CPU held 2.3x the cache shard in temporaries,
    against 1.15x, in test_one_kv_cache_in_memory). Four per halving of the slots (S = 64: 64, 56, 48, 40, 32, 28,
    24, 20, 16, then 14, 12, 10, 8, 6, 4, 2, where steps of 2 are the finest); for completions of fewer than
    FINE_WIDTHS_MIN_TOKENS new tokens, halves only (64, 32, 16, 8, 4, 2). Once the queue is empty and every shard's
    live slots fit the next width, they move into its slots, and each step computes only those rows: on CPU a step
    costs about the rows it computes, and the finer widths compute at most about 4/3 of the live rows (halves: up to
    2x). Each width is one more decode loop body to compile; on the long-tail benchmark (64 rows, 512 tokens) the 16
    widths ran 2.5-8.9% faster than session 10's 7 in three A/B runs (docs/PERFORMANCE.md, session 11)."""
    if slots % dp:
        return (slots,)
    per_shard = slots // dp
    floor = max(2, per_shard // 32)
    fine = new_tokens is None or new_tokens >= FINE_WIDTHS_MIN_TOKENS
    widths = [per_shard]
    while True:
        below = 1 << max(0, (widths[-1] - 1).bit_length() - 1)  # the largest power of two under the width
        width = widths[-1] - max(2, below // 4) if fine else widths[-1] // 2
        if width < floor:
            return tuple(w * dp for w in widths)
        widths.append(width)


def queue_groups(rows: int, prompts: int, slots: int, dp: int) -> int:
    """How many queues the pool keeps: one per data-parallel shard where rows, prompts and slots split evenly over
    the shards (a shard's slots then take only its own rows, whose prompts it holds: rows.layout places them so),
    else one."""
    return dp if dp > 1 and not (rows % dp or prompts % dp or slots % dp) else 1


def gather_rows(x_B: jax.Array, source_N: jax.Array, Q: int) -> jax.Array:
    """x_B[source_N], within each of Q groups (rows of group q take from block q of x_B): with Q = the data-parallel
    shards the gather stays on each device."""
    if Q == 1:
        return x_B[source_N]
    B, N = x_B.shape[0], source_N.shape[0]
    local_Qxn = source_N.reshape(Q, N // Q) - (B // Q) * jnp.arange(Q, dtype=jnp.int32)[:, None]
    return jax.vmap(lambda x, i: x[i])(x_B.reshape(Q, B // Q, *x_B.shape[1:]), local_Qxn).reshape(N, *x_B.shape[1:])


def prefill_sequences(cfg: ModelConfig, params: Params, tokens_BxW: jax.Array, mask_BxW: jax.Array, P: int, dp: int,
             carrying: int, forms: DecodeForms) -> tuple[jax.Array, tuple]:
    """(each sequence's hidden state at its last real position [B, 1, D], the caches [B, L, K, W, H], or one
    [B, K, W, H] pair per layer as forms.stacked_cache says) of sequences in
    the prompt bucket P, then W - P carried positions. With `carrying`, the first `carrying` sequences of each of the
    dp blocks are prefilled over all W positions and the others over P (their carried positions are padding: a
    fresh prompt's prefill costs its bucket, not the longest carried row's), their caches padded to W."""
    B, W = tokens_BxW.shape
    # the caches as bits where the platform's forms say so: never converted whole (kv_cache.BITS)
    bits = kv_cache.BITS if jnp.dtype(cfg.compute_dtype).itemsize == 2 and forms.cache_bits else None

    def run(tokens, mask):  # the last real position: the prompt's (P - 1), or a sequence's last carried token's
        h_BxTxD, cache = model_lib.prefill(cfg, params, tokens, mask, bits, forms.stacked_cache, forms)
        last_B = P - 1 + jnp.sum(mask[:, P:], axis=-1, dtype=jnp.int32)
        return jnp.take_along_axis(h_BxTxD, last_B[:, None, None], axis=1), cache
    if W == P or not carrying or carrying * dp == B:
        return run(tokens_BxW, mask_BxW)
    w = B // dp
    part = lambda a, lo, hi, cols: a.reshape(dp, w, W)[:, lo:hi, :cols].reshape(dp * (hi - lo), cols)
    h_c, cache_c = run(part(tokens_BxW, 0, carrying, W), part(mask_BxW, 0, carrying, W))
    h_f, cache_f = run(part(tokens_BxW, carrying, w, P), part(mask_BxW, carrying, w, P))
    pad = lambda c: jnp.pad(c, [(0, 0)] * (c.ndim - 2) + [(0, W - P), (0, 0)])
    merge = lambda a, b: jnp.concatenate([a.reshape(dp, carrying, *a.shape[1:]), b.reshape(dp, w - carrying,
                                                                                        *b.shape[1:])],
                                         axis=1).reshape(B, *a.shape[1:])
    return merge(h_c, h_f), jax.tree.map(lambda c, f: merge(c, pad(f)), cache_c, cache_f)


def auto_slots(cfg: ModelConfig, rows: int, prompts: int, cache_len: int, prompt_len: int, mesh: Mesh | None,
               headroom: float = 0.8) -> int:
    """The most slots (a multiple of data x fsdp, at most `rows`) whose KV cache fits `headroom` of the first local
    device's free memory once the prompt caches are counted; all rows where the backend reports no limit (CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return rows
    dp = mesh.shape["data"] * mesh.shape["fsdp"] if mesh is not None else 1
    tp = mesh.shape["tensor"] if mesh is not None and cfg.num_kv_heads % mesh.shape["tensor"] == 0 else 1
    per_position = 2 * cfg.num_layers * (cfg.num_kv_heads // tp) * cfg.head_dim * jnp.dtype(cfg.compute_dtype).itemsize
    free = headroom * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)) - per_position * prompt_len * prompts / dp
    per_device = int(free // (per_position * cache_len))
    return max(dp, min(rows, per_device * dp) // dp * dp)
