"""Full-sequence (training / no-grad pass) attention, causal within segments, chosen by `ModelConfig.attention`.

Query t may attend to key s when s <= t and both carry the same segment id > 0; a position with segment id 0 is
padding and attends to itself only (its output is ignored, this keeps its softmax finite). One row may hold several
sequences (packing: ids 1, 2, ... with per-segment positions), or one left-padded sequence (ids = the mask).

  naive      the [B, K, G, T, S] scores in one einsum: fastest for short rows, memory quadratic in T; on XLA:CPU a
             few rows at a time (`row_groups`: each group's scores stay in the caches)
  blockwise  flash-style online softmax over [block, block] tiles in plain JAX, with a hand-written backward that
             recomputes the tiles: no [T, T] buffer in either pass, runs on every backend; dead tiles are skipped:
             causally dead ones, and in packed rows those between different sequences in every row of the batch
             (each query tile's loop starts at the earliest tile its rows' sequences start in, `tile_ranges`;
             correct for any segment ids, contiguous or not)
  cudnn      jax.nn.dot_product_attention(implementation="cudnn") (GPU, bf16 / fp16), mask given per row
  splash     the Pallas TPU splash-attention kernel with segment ids (TPU)
  auto       cudnn on GPU in bf16/fp16, splash on TPU, else naive up to AUTO_NAIVE_MAX_LEN keys and blockwise beyond
An accelerator kernel asked for on a backend (or dtype) that lacks it falls back to blockwise.
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp

log = logging.getLogger("sage_jax")
IMPLEMENTATIONS = ("auto", "naive", "blockwise", "cudnn", "splash")
AUTO_NAIVE_MAX_LEN = 256  # CPU, fp32: blockwise was 1.4-1.8x faster forward + backward from 256 keys up
# blockwise's largest tile on XLA:CPU: forward + backward (8 heads of 64, fp32) 2.8x faster than 512-tiles at 12 rows
# of 1,000, 2.0x at 4 of 2,048, within 10% of the best tile at every shape tried (docs/PERFORMANCE.md, "Partial
# rollouts"); larger tiles' [rows, heads, tile, tile] scores spill the caches
CPU_TILE = 128
# naive attention on XLA:CPU runs row groups whose fp32 scores take at most this many bytes, in turn: forward +
# backward of 64 rows of 160 positions (8 heads of 64) 261 ms at once, 207 ms four rows at a time (5 MiB would allow
# six); forward 108 -> 60 ms. The whole batch's 52 MiB of scores went through memory four times
CPU_SCORES_BYTES = 5 << 20
_MASKED = -1e30  # finite: a tile with no allowed key must not turn the running max into -inf (exp(-inf + inf))


def allowed_mask(seg_q_BxT: jax.Array, seg_k_BxS: jax.Array, q_start=0, k_start=0) -> jax.Array:
    """bool [B, T, S]: causal within equal positive segments, plus the diagonal (see the module docstring)."""
    qi = q_start + jnp.arange(seg_q_BxT.shape[1])[:, None]
    kj = k_start + jnp.arange(seg_k_BxS.shape[1])[None, :]
    same = (seg_q_BxT[:, :, None] == seg_k_BxS[:, None, :]) & (seg_k_BxS[:, None, :] > 0)
    return ((kj <= qi) & same) | (kj == qi)


def segment_positions(segment_ids_BxT: jax.Array) -> jax.Array:
    """Positions that restart at 0 wherever the segment id changes (contiguous segments)."""
    T = segment_ids_BxT.shape[1]
    idx_T = jnp.arange(T)
    starts = jnp.concatenate([jnp.ones_like(segment_ids_BxT[:, :1], jnp.bool_),
                              segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]], axis=1)
    return idx_T - jax.lax.cummax(jnp.where(starts, idx_T, 0), axis=1)


def masked(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, allowed_BxTxS) -> jax.Array:
    """Attention under an explicit [B, T, S] mask (the scores materialised)."""
    B, T, N, H = q_BxTxNxH.shape
    K = k_BxSxKxH.shape[2]
    q = q_BxTxNxH.reshape(B, T, K, N // K, H)
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k_BxSxKxH, preferred_element_type=jnp.float32) / math.sqrt(H)
    scores = jnp.where(allowed_BxTxS[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BxSxKxH.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs, v_BxSxKxH).reshape(B, T, N, H)


def naive(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT) -> jax.Array:
    return masked(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, allowed_mask(segment_ids_BxT, segment_ids_BxT))


def row_groups(B: int, N: int, T: int, S: int, budget: int) -> int:
    """How many groups of rows naive attention on XLA:CPU runs in turn: the fewest that divide B and keep one
    group's [rows, N, T, S] fp32 scores within `budget` bytes (1: all rows at once; B: one row at a time, where even
    one row's are larger)."""
    per_row = 4 * N * T * S
    return next((n for n in range(1, B + 1) if B % n == 0 and (B // n) * per_row <= budget), B)


def naive_in_groups(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT, groups: int) -> jax.Array:
    """naive attention over `groups` groups of consecutive rows one after another (lax.map), each group's scores
    recomputed in the backward. (Groups of strided rows, which would keep a row axis split over devices split, ran
    the 64 x 160 case 17% slower forward + backward: the transposes in and out.)"""
    if groups <= 1:
        return naive(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT)
    split = lambda a: a.reshape(groups, -1, *a.shape[1:])
    out = jax.lax.map(jax.checkpoint(lambda xs: naive(*xs)),
                      tuple(map(split, (q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT))))
    return out.reshape(q_BxTxNxH.shape)


# --------------------------------------------------------------------------------------------------- blockwise

def _tile(a, i, size, axis):
    return jax.lax.dynamic_slice_in_dim(a, i * size, size, axis)


def _tile_scores(q_BxKxGxQxH, k_BxKxCxH, seg_q_BxQ, seg_k_BxC, qi, kj, block, scale):
    s = jnp.einsum("bkgqh,bkch->bkgqc", q_BxKxGxQxH, k_BxKxCxH, preferred_element_type=jnp.float32) * scale
    allowed = allowed_mask(seg_q_BxQ, seg_k_BxC, qi * block, kj * block)
    return jnp.where(allowed[:, None, None], s, _MASKED)


def _occurrences(seg_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(first [B, T], last [B, T]): the first / last position in its row that carries the token's segment id; any
    ids, contiguous or not (a stable sort groups equal ids with their positions ascending)."""
    B, T = seg_BxT.shape
    order_BxT = jnp.argsort(seg_BxT, axis=1, stable=True)
    sorted_BxT = jnp.take_along_axis(seg_BxT, order_BxT, axis=1)
    k = jnp.broadcast_to(jnp.arange(T), (B, T))
    new_group = jnp.concatenate([jnp.ones((B, 1), bool), sorted_BxT[:, 1:] != sorted_BxT[:, :-1]], axis=1)
    group_end = jnp.concatenate([sorted_BxT[:, 1:] != sorted_BxT[:, :-1], jnp.ones((B, 1), bool)], axis=1)
    head = jax.lax.cummax(jnp.where(new_group, k, 0), axis=1)
    tail = jax.lax.cummin(jnp.where(group_end, k, T - 1), axis=1, reverse=True)
    rows = jnp.arange(B)[:, None]
    first = jnp.zeros((B, T), jnp.int32).at[rows, order_BxT].set(jnp.take_along_axis(order_BxT, head, axis=1))
    last = jnp.zeros((B, T), jnp.int32).at[rows, order_BxT].set(jnp.take_along_axis(order_BxT, tail, axis=1))
    return first, last


def tile_ranges(seg_BxT: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """(first [n], last [n]) int32: query tile i needs key tiles first[i]..i, key tile j is needed by query tiles
    j..last[j], over all rows of the batch. A token may attend back to the first position with its segment id and
    be attended to up to the last one, whether or not the id's positions are contiguous (ids [1]*64 + [0]*128 +
    [1]*64 included); padding (id 0) attends to itself only. The tiles in between are visited and masked."""
    B, T = seg_BxT.shape
    t = jnp.arange(T)
    first_BxT, last_BxT = _occurrences(seg_BxT)
    start = jnp.where(seg_BxT > 0, first_BxT, t)
    end = jnp.where(seg_BxT > 0, last_BxT, t)
    first = jnp.min(start.reshape(B, T // block, block), axis=(0, 2)) // block
    last = jnp.max(end.reshape(B, T // block, block), axis=(0, 2)) // block
    return first.astype(jnp.int32), last.astype(jnp.int32)


def _forward(q, k, v, seg, block, scale):
    """q [B,K,G,T,H], k/v [B,K,T,H], seg [B,T], T a multiple of block -> (out like q, logsumexp [B,K,G,T] fp32)."""
    B, K, G, T, H = q.shape
    n = T // block
    first, _ = tile_ranges(seg, block)

    def q_tile(i):
        qi, seg_i = _tile(q, i, block, 3), _tile(seg, i, block, 1)

        def step(j, carry):
            m, l, acc = carry
            s = _tile_scores(qi, _tile(k, j, block, 2), seg_i, _tile(seg, j, block, 1), i, j, block, scale)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            pv = jnp.einsum("bkgqc,bkch->bkgqh", p.astype(v.dtype), _tile(v, j, block, 2),
                            preferred_element_type=jnp.float32)
            return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

        init = (jnp.full((B, K, G, block), _MASKED, jnp.float32), jnp.zeros((B, K, G, block), jnp.float32),
                jnp.zeros((B, K, G, block, H), jnp.float32))
        m, l, acc = jax.lax.fori_loop(first[i], i + 1, step, init)
        return (acc / l[..., None]).astype(q.dtype), m + jnp.log(l)

    out, lse = jax.lax.map(q_tile, jnp.arange(n))  # [n, B, K, G, block, ...]
    return (jnp.moveaxis(out, 0, 3).reshape(B, K, G, T, H), jnp.moveaxis(lse, 0, 3).reshape(B, K, G, T))


def _backward(q, k, v, seg, out, lse, d_out, block, scale):
    """Flash-attention-2 backward: dq by query tiles, dk / dv by key tiles, each tile's probabilities recomputed."""
    B, K, G, T, H = q.shape
    n = T // block
    first, last = tile_ranges(seg, block)
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B,K,G,T]

    def probs_and_ds(i, j):
        qi, kj = _tile(q, i, block, 3), _tile(k, j, block, 2)
        s = _tile_scores(qi, kj, _tile(seg, i, block, 1), _tile(seg, j, block, 1), i, j, block, scale)
        p = jnp.exp(s - _tile(lse, i, block, 3)[..., None])
        dp = jnp.einsum("bkgqh,bkch->bkgqc", _tile(d_out, i, block, 3), _tile(v, j, block, 2),
                        preferred_element_type=jnp.float32)
        return p, p * (dp - _tile(delta, i, block, 3)[..., None])

    def dq_tile(i):
        def step(j, dq):
            _, ds = probs_and_ds(i, j)
            return dq + jnp.einsum("bkgqc,bkch->bkgqh", ds.astype(k.dtype), _tile(k, j, block, 2),
                                   preferred_element_type=jnp.float32)
        return jax.lax.fori_loop(first[i], i + 1, step, jnp.zeros((B, K, G, block, H), jnp.float32)) * scale

    def dkv_tile(j):
        def step(i, carry):
            dk, dv = carry
            p, ds = probs_and_ds(i, j)
            dv = dv + jnp.einsum("bkgqc,bkgqh->bkch", p.astype(v.dtype), _tile(d_out, i, block, 3),
                                 preferred_element_type=jnp.float32)
            dk = dk + jnp.einsum("bkgqc,bkgqh->bkch", ds.astype(q.dtype), _tile(q, i, block, 3),
                                 preferred_element_type=jnp.float32)
            return dk, dv
        zeros = jnp.zeros((B, K, block, H), jnp.float32)
        # causal, square tiles: query tiles before key tile j see none of its keys, those after last[j] neither
        dk, dv = jax.lax.fori_loop(j, last[j] + 1, step, (zeros, zeros))
        return dk * scale, dv

    dq = jnp.moveaxis(jax.lax.map(dq_tile, jnp.arange(n)), 0, 3).reshape(B, K, G, T, H)
    dk, dv = jax.lax.map(dkv_tile, jnp.arange(n))
    dk, dv = (jnp.moveaxis(a, 0, 2).reshape(B, K, T, H) for a in (dk, dv))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(q, k, v, seg, block, scale):
    return _forward(q, k, v, seg, block, scale)[0]


def _flash_fwd(q, k, v, seg, block, scale):
    out, lse = _forward(q, k, v, seg, block, scale)
    return out, (q, k, v, seg, out, lse)


def _flash_bwd(block, scale, res, d_out):
    q, k, v, seg, out, lse = res
    dq, dk, dv = _backward(q, k, v, seg, out, lse, d_out, block, scale)
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def block_size(T: int, block: int = 512) -> int:
    """The largest tile (a power of two from `block` down to 64) that pads T by at most an eighth; 64 otherwise."""
    b = block
    while b > 64 and (-T % b) * 8 > T:
        b //= 2
    return b


def blockwise(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT, block: int = 512) -> jax.Array:
    B, T, N, H = q_BxTxNxH.shape
    K = k_BxTxKxH.shape[2]
    b = block_size(T, block)
    pad = -T % b
    # padded tail positions get segment 0: they attend to themselves only and nothing attends to them
    seg = jnp.pad(segment_ids_BxT.astype(jnp.int32), ((0, 0), (0, pad)))
    q = jnp.pad(q_BxTxNxH, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(B, T + pad, K, N // K, H)
    kv = lambda a: jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    out = _flash(q.transpose(0, 2, 3, 1, 4), kv(k_BxTxKxH), kv(v_BxTxKxH), seg, b, 1.0 / math.sqrt(H))
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T + pad, N, H)[:, :T]


# --------------------------------------------------------------------------------------------------- accelerators

def cudnn(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT) -> jax.Array:
    """cuDNN fused attention; the [B, 1, T, T] boolean mask is one per row (not per head or layer)."""
    allowed = allowed_mask(segment_ids_BxT, segment_ids_BxT)[:, None]
    return jax.nn.dot_product_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, mask=allowed, implementation="cudnn")


def splash(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT, block: int = 512, interpret: bool = False):
    """Pallas splash attention, one multi-query kernel per (row, kv head) over its G query heads."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa
    B, T, N, H = q_BxTxNxH.shape
    K = k_BxTxKxH.shape[2]
    G = N // K
    b = min(block, T)
    kernel = sa.make_splash_mqa_single_device(
        sa.MultiHeadMask([sa.CausalMask((T, T))] * G), interpret=interpret,
        block_sizes=sa.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                                  block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b))
    # splash's segment rule has no "padding attends to itself": give each padding position its own negative id
    seg = segment_ids_BxT.astype(jnp.int32)
    seg = jnp.where(seg > 0, seg, -1 - jnp.arange(T, dtype=jnp.int32)[None])
    q = (q_BxTxNxH / math.sqrt(H)).reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
    k, v = k_BxTxKxH.transpose(0, 2, 1, 3), v_BxTxKxH.transpose(0, 2, 1, 3)  # [B, K, T, H]

    def one(q_GxTxH, k_TxH, v_TxH, seg_T):
        return kernel(q_GxTxH, k_TxH, v_TxH, segment_ids=sa.SegmentIds(q=seg_T, kv=seg_T))

    def local(q, k, v, seg):
        return jax.vmap(jax.vmap(one, in_axes=(0, 0, 0, None)))(q, k, v, seg)
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:  # a Pallas kernel is not partitioned by XLA: run it per shard (rows over batch, kv heads)
        from sage_jax.models import sharding
        rules = sharding._RULES.get() or sharding.DEFAULT_RULES
        spec = lambda *axes: sharding.logical_to_spec(axes, rules)
        heads = spec("batch", "kv_heads", None, None, None)
        local = jax.shard_map(local, in_specs=(heads, spec("batch", "kv_heads", None, None), spec("batch", "kv_heads",
                              None, None), spec("batch", None)), out_specs=heads, check_vma=False)
    out = local(q, k, v, seg)
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)


# --------------------------------------------------------------------------------------------------- dispatch

def resolve(impl: str, seq_len: int, compute_dtype) -> str:
    """The implementation that runs for `impl` on this backend: auto's choice, and the blockwise fallback."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"model.attention={impl!r} is unknown; choose one of {IMPLEMENTATIONS}")
    backend = jax.default_backend()
    half = jnp.dtype(compute_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if impl == "auto":
        impl = ("cudnn" if backend == "gpu" and half else "splash" if backend == "tpu"
                else "naive" if seq_len <= AUTO_NAIVE_MAX_LEN else "blockwise")
    if (impl == "cudnn" and not (backend == "gpu" and half)) or (impl == "splash" and backend != "tpu"):
        return "blockwise"
    return impl


def attend(impl: str, q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT, block: int = 512) -> jax.Array:
    """Causal attention within segments (module docstring) by the implementation `impl` resolves to."""
    impl = resolve(impl, q_BxTxNxH.shape[1], q_BxTxNxH.dtype)
    args = (q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT)
    platform, devices = _target()
    if impl == "naive":
        if platform != "cpu" or devices > 1:  # (a simulated CPU mesh keeps whole-batch scores: rows split there)
            return naive(*args)
        B, T, N, _ = q_BxTxNxH.shape
        return naive_in_groups(*args, row_groups(B, N, T, T, CPU_SCORES_BYTES))
    if impl in ("cudnn", "splash"):
        try:  # the kernels check shapes, dtypes and library versions while tracing: fall back rather than fail
            return cudnn(*args) if impl == "cudnn" else splash(*args, block)
        except (ValueError, NotImplementedError, RuntimeError) as e:
            log.warning("model.attention=%r cannot run these shapes (%s); using 'blockwise'", impl, e)
    return blockwise(*args, min(block, CPU_TILE) if platform == "cpu" else block)


def _target() -> tuple[str, int]:
    """The platform the program being traced is for and its device count: the current mesh's (sage_jax.plan compiles
    TPU programs on a CPU host), else the default backend's, one device."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh is None or mesh.empty else getattr(mesh, "abstract_device", None)
    return (device.platform, mesh.size) if device is not None else (jax.default_backend(), 1)
