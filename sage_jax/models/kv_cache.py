"""The KV cache: its layout, its writes and the attention that reads it (model.forward_with_cache runs them).

A cache is either one (k, v) pair per layer, each [R, K, S, H] (rows, kv heads, slots, head dim: init_cache), or
one stacked pair, each [R, L, K, S, H] (init_cache(..., stacked=True): a row's layers side by side, so the row
groups of a data-parallel shard stay the leading axis and a layer is a strided view, never a transposed copy).

Which layout the sampler's slot pool holds, and how a decode step reads it, is decode_forms' choice per platform: on
XLA:CPU a stacked cache read in a loop over the layers (the compiler holds one layer's weights, gathered and
converted to float32, at a time); on XLA:TPU and XLA:GPU a pair per layer with the layers unrolled (a stacked cache
read at a loop-variable layer was copied whole into another layout in every layer iteration by XLA:TPU). Functions
that take `layer` read and write layer `layer` of a stacked cache; with layer=None the cache is one layer's.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from sage_jax.models import decode_attention
from sage_jax.models.decode_forms import DecodeForms, for_platform

DECODE_BLOCK = 64  # cache slots per step of the blocked decode attention (decode_forms: XLA:CPU's form)
# A KV cache of this dtype holds a 16-bit compute dtype's bits. The slot pool's cache is one: written, copied and
# sliced as bits, it is never converted whole (XLA:TPU kept a uint16 copy beside a bfloat16 one of every layer's
# cache, XLA:CPU float32 copies, when bf16 <-> uint16 bitcasts sat at the loops' boundaries).
BITS = jnp.dtype(jnp.uint16)


def init_cache(cfg, batch: int, max_len: int, dtype: str | None = None, stacked: bool = False):
    """Zeros: one (k, v) pair per layer, each [B, KV, max_len, hd] (heads before slots: see cached_attention), or with
    stacked=True one (k, v) pair [B, L, KV, max_len, hd]; dtype BITS (uint16): a 16-bit compute dtype's bits, read
    and written as such by model.forward_with_cache."""
    dt = jnp.dtype(dtype or cfg.compute_dtype)
    shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    if stacked:
        return tuple(jnp.zeros((batch, cfg.num_layers, *shape[1:]), dt) for _ in range(2))
    return [(jnp.zeros(shape, dt), jnp.zeros(shape, dt)) for _ in range(cfg.num_layers)]


def cache_axes(stacked: bool = False) -> tuple[str, ...]:
    """A cache array's logical axes (sharding.constrain)."""
    return ("decode_rows",) + ("layers",) * stacked + ("kv_heads", "cache_seq", "head_dim")


def cache_rows(c, rows: int, groups: int = 1, start=0, length: int | None = None, layer=None) -> jax.Array:
    """[rows, K, length, H]: the cache rows a batch of `rows` rows uses, cache slots [start, start + length), of
    layer `layer` of a stacked cache: all R rows when rows == R, else the first rows / groups of each of `groups`
    equal row groups (the sampler's pool shrinks inside each data-parallel shard, so the groups are the shards and
    no row crosses one). Only that part is read."""
    c_RxLxKxSxH = c if layer is not None else c[:, None]
    R, L, K, S, H = c_RxLxKxSxH.shape
    length = S if length is None else length
    if layer is None and rows == R and length == S:
        return c
    grouped = c_RxLxKxSxH.reshape(groups, R // groups, L, K, S, H)
    at = (0, 0, 0 if layer is None else layer, 0, start, 0)
    part = jax.lax.dynamic_slice(grouped, at, (groups, rows // groups, 1, K, length, H))
    return part.reshape(rows, K, length, H)


def as_bits(x, dtype) -> jax.Array:
    """x in a cache of `dtype`: a uint16 cache holds a 16-bit float's bits (init_cache(..., BITS))."""
    if dtype == BITS and x.dtype.itemsize == 2:
        return jax.lax.bitcast_convert_type(x, BITS)
    return x.astype(dtype)


def from_cache(c, cdt) -> jax.Array:
    """A cache array in the compute dtype: a bitcast for a bits cache (free, and XLA folds it into the bitcasts of
    the blocked decode attention's slices), else a convert."""
    cdt = jnp.dtype(cdt)
    return jax.lax.bitcast_convert_type(c, cdt) if c.dtype == BITS and cdt.itemsize == 2 else c.astype(cdt)


def write(c, x_BxTxKxH, index, groups: int = 1, layer=None, forms: DecodeForms | None = None) -> jax.Array:
    """x written at cache positions [index, index + T): one index for all rows, or one per row ([B]: the decode
    slots of sampler's pool each have their own), a scatter of each row's T entries, into the rows cache_rows
    names when the cache has more rows than x (R > B; then T = 1); into layer `layer` of a stacked cache."""
    x_BxKxTxH = as_bits(x_BxTxKxH.swapaxes(1, 2), c.dtype)
    if jnp.ndim(index) == 0:  # one position for all rows (a prefill)
        if layer is None:
            return jax.lax.dynamic_update_slice_in_dim(c, x_BxKxTxH, index, 2)
        return jax.lax.dynamic_update_slice(c, x_BxKxTxH[:, None], (0, layer, 0, index, 0))
    # A 16-bit float scatter is done in float32 by XLA:CPU, which then carries a float32 copy of the whole cache
    # through the decode loop (2x its bytes, plus the converts); the same bits scattered as uint16 are not.
    two = c.dtype.itemsize == 2 and (forms is None or forms.cache_bits)
    bits = (lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16)) if two else (lambda a: a)
    R, B = c.shape[0], x_BxKxTxH.shape[0]
    split = lambda a, n: a.reshape(groups, n // groups, *a.shape[1:])
    if isinstance(layer, int) and R == B:
        # Layers unrolled (a Python int: sampler's unstack_layers, the CPU default): one update per row. Under a loop
        # over the layers every width takes the scatter below instead: XLA:TPU laid the cache out one way for this
        # update and another for the scatter, and copied the whole cache between the pool's widths (3.76 GB/chip).
        put = lambda c, x, i: jax.lax.dynamic_update_slice(c, x[None], (layer, 0, i, 0))
        out = jax.vmap(put)(bits(c), bits(x_BxKxTxH), index)
    elif layer is None and R == B:
        put = lambda c, x, i: jax.lax.dynamic_update_slice_in_dim(c, x, i, 1)
        out = jax.vmap(put)(bits(c), bits(x_BxKxTxH), index)
    else:  # row b of group d (of B / groups each) is cache row d * R / groups + b % (B / groups)
        assert x_BxKxTxH.shape[2] == 1, "a stacked cache, or part of the cache rows, is written one position per row"
        at = () if layer is None else (layer,)

        def group(c_r, x_bxKx1xH, index_b):  # a scatter of b entries into r rows, in place: no slice of the rows
            return c_r.at[(jnp.arange(index_b.shape[0]), *at, slice(None), index_b)].set(x_bxKx1xH[:, :, 0])
        out = jax.vmap(group)(split(bits(c), R), split(bits(x_BxKxTxH), B), split(index, B))
    out = out.reshape(c.shape)
    return jax.lax.bitcast_convert_type(out, c.dtype) if two else out


def cached_attention(q_BxTxNxH, k_cache, v_cache, allowed_BxTxS, groups: int = 1, layer=None, dtype=None,
                     forms: DecodeForms | None = None) -> jax.Array:
    """Attention over a cache (R >= B rows: see cache_rows; a bits cache read as `dtype`, default the cache's), in
    the decode forms `forms` (default: the running backend's, decode_forms.for_platform): (b, k) lead both
    operands, so XLA:CPU runs plain batched matmuls instead of transposing the whole cache every decode step."""
    B, T, N, H = q_BxTxNxH.shape
    K, S = k_cache.shape[-3], k_cache.shape[-2]
    forms = forms or for_platform(jax.default_backend())
    dtype = jnp.dtype(dtype or v_cache.dtype)
    q = q_BxTxNxH.reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4).reshape(B, K, (N // K) * T, H)
    allowed = jnp.tile(allowed_BxTxS, (1, N // K, 1))[:, None]  # rows ordered (g, t) like q
    if T == 1 and forms.attention == "kernel":  # each row's live slots only (one contiguous range per row)
        k_BxKxSxH, v_BxKxSxH = (from_cache(cache_rows(c, B, groups, layer=layer), dtype) for c in (k_cache, v_cache))
        out = decode_attention.attend(forms.platform, q.astype(dtype), k_BxKxSxH, v_BxKxSxH,
                                      *decode_attention.live_range(allowed_BxTxS[:, 0]), forms.interpret)
    elif T == 1 and S > DECODE_BLOCK and forms.attention == "blocked":
        reads_B = S - jnp.argmax(allowed_BxTxS[:, 0, ::-1], axis=-1)  # one past the last slot row b may read
        split = forms.position_groups
        split = split if (groups == 1 and split > 1 and B % split == 0 and B >= 4 * split) else 1
        if split == 1:
            out = _blocked_decode_attention(q, k_cache, v_cache, allowed, jnp.max(reads_B), groups, layer, dtype,
                                            forms)
        else:  # rows by how far they read, each group of B / split to its own furthest row
            order_B, n = jnp.argsort(reads_B).astype(jnp.int32), B // split
            groups_of_rows = (order_B[i * n:(i + 1) * n] for i in range(split))
            parts = [_blocked_decode_attention(q[rows], k_cache, v_cache, allowed[rows], reads_B[rows[-1]], 1, layer,
                                               dtype, forms, rows) for rows in groups_of_rows]
            out = jnp.zeros_like(q).at[order_B].set(jnp.concatenate(parts))
    else:
        k_BxKxSxH, v_BxKxSxH = (from_cache(cache_rows(c, B, groups, layer=layer), dtype) for c in (k_cache, v_cache))
        if T == 1:
            scores = _decode_scores(q, k_BxKxSxH, forms)
        else:
            scores = jnp.einsum("bkqh,bksh->bkqs", q, k_BxKxSxH, preferred_element_type=jnp.float32)
        scores = jnp.where(allowed, scores / math.sqrt(H), jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v_BxKxSxH.dtype)
        acc = jnp.float32 if forms.scores == "matmul" else None  # XLA:CPU: as it measured best, unchanged
        out = jnp.einsum("bkqs,bksh->bkqh", probs, v_BxKxSxH, preferred_element_type=acc).astype(dtype)
    return out.reshape(B, K, N // K, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)


def _decode_scores(q_BxKxGxH, k_BxKxSxH, forms: DecodeForms) -> jax.Array:
    """[B, K, G, S] float32 scores of one query per row. XLA:CPU: a multiply-and-sum in float32 reads the cache
    once (a matmul with G-row operands first repacks it); TPU / GPU: a matmul on the matrix units, f32 accumulation."""
    if forms.scores == "matmul":
        return jnp.einsum("bkgh,bksh->bkgs", q_BxKxGxH.astype(k_BxKxSxH.dtype), k_BxKxSxH,
                          preferred_element_type=jnp.float32)
    f32 = jnp.float32
    return jnp.sum(q_BxKxGxH[:, :, :, None].astype(f32) * k_BxKxSxH[:, :, None].astype(f32), axis=-1)


def _row_blocks(c, rows_n: jax.Array, start, length: int, layer) -> jax.Array:
    """[n, K, length, H]: cache rows rows_n (one row group: batch row b is cache row b), slots [start, start +
    length), of layer `layer` of a stacked cache (None: the cache is one layer's)."""
    c_RxLxKxSxH = c if layer is not None else c[:, None]
    K, H = c_RxLxKxSxH.shape[2], c_RxLxKxSxH.shape[4]
    at = 0 if layer is None else layer
    one = lambda r: jax.lax.dynamic_slice(c_RxLxKxSxH, (r, at, 0, start, 0), (1, 1, K, length, H))[0, 0]
    return jax.vmap(one)(rows_n)


def _blocked_decode_attention(q_BxKxGxH, k_cache, v_cache, allowed_Bx1xGxS, end, groups: int, layer,
                              dtype, forms: DecodeForms, rows_B: jax.Array | None = None) -> jax.Array:
    """One query per row over the cache slots [0, end), DECODE_BLOCK at a time with a running softmax: a decode step
    reads the part of the cache written so far (of its own rows: cache_rows, or the cache rows rows_B), not all of
    it. A row's blocks past its own last slot are all masked and leave its sums as they are (exp(-inf) = 0, rescale
    1): reading further changes nothing, and a row's result is the same whatever batch it runs in, up to the rounding
    XLA:CPU's kernels give batches of different sizes (1 ulp, as the pool's widths already do)."""
    S, H = k_cache.shape[-2:]
    B, K, G, _ = q_BxKxGxH.shape
    blk = DECODE_BLOCK
    f32 = jnp.float32

    def block(j, carry):
        max_BxKxG, sum_BxKxG, acc_BxKxGxH = carry
        start = jnp.minimum(j * blk, S - blk)  # the last block is shifted back to fit; its re-read slots are masked
        take = (lambda c: cache_rows(c, B, groups, start, blk, layer)) if rows_B is None else \
            (lambda c: _row_blocks(c, rows_B, start, blk, layer))
        ok = jax.lax.dynamic_slice_in_dim(allowed_Bx1xGxS, start, blk, axis=3) & (start + jnp.arange(blk) >= j * blk)
        k_blk, v_blk = (jax.lax.bitcast_convert_type(take(c), dtype) if c.dtype != dtype else take(c)
                        for c in (k_bits, v_bits))
        scores = jnp.where(ok, _decode_scores(q_BxKxGxH, k_blk, forms) / math.sqrt(H), -jnp.inf)
        new_max = jnp.maximum(max_BxKxG, jnp.max(scores, axis=-1))
        probs = jnp.where(ok, jnp.exp(scores - new_max[..., None]), 0.0)
        rescale = jnp.exp(max_BxKxG - new_max)
        mixed = jnp.einsum("bkgs,bksh->bkgh", probs.astype(dtype), v_blk, preferred_element_type=f32)
        return new_max, sum_BxKxG * rescale + jnp.sum(probs, axis=-1), acc_BxKxGxH * rescale[..., None] + mixed

    # Blocks sliced from the cache's bits: XLA:CPU computes 16-bit float products in float32 and would otherwise
    # convert the whole cache to float32 once, outside the loop (two float32 copies of every layer's cache held).
    bits = lambda c: jax.lax.bitcast_convert_type(c, BITS) if c.dtype.itemsize == 2 and c.dtype != BITS else c
    k_bits, v_bits = bits(k_cache), bits(v_cache)
    init = (jnp.full((B, K, G), jnp.finfo(f32).min, f32), jnp.zeros((B, K, G), f32), jnp.zeros((B, K, G, H), f32))
    _, total, acc = jax.lax.fori_loop(0, -(-end // blk), block, init)
    return (acc / total[..., None]).astype(dtype)
