"""Decode attention kernels that read only each row's live cache positions (Pallas; decode_forms picks them).

One query token per row, G = N / K query heads per KV head, over a cache [B, K, S, H] of which row b may read the
slots [start_B[b], end_B[b]) (its left-padded prompt and what it has generated so far: one contiguous range, as the
sampler's rows are laid out; live_range finds it from the attention mask).

  tpu   our kernel: grid (rows, kv heads, blocks of BLOCK slots) with the ranges prefetched as scalars; a block
        outside a row's range maps to the row's last live block, so the pipeline fetches nothing new for it, and its
        compute is skipped: a row costs its own length, not S
  gpu   jax.experimental.pallas.ops.gpu.decode_attention.gqa (start_idx / kv_seq_len per row), in the JAX we pin
On the CPU both run in Pallas interpret mode (tests, and decode_forms' attention="kernel" forced there).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from sage_jax.models import sharding

BLOCK = 128  # cache slots per kernel block (TPU: a multiple of 8 sublanes; GPU: Triton's block_k)
GPU_SPLITS = 16  # the GPU kernel's parallel splits of the cache axis (its k_splits), fewer for short caches
_MASKED = -1e30  # finite, so that a block with no live slot leaves the running max finite


def live_range(allowed_BxS: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(start_B, end_B) int32: the first allowed slot and one past the last (a row with none: 0, 1)."""
    S = allowed_BxS.shape[-1]
    any_B = jnp.any(allowed_BxS, axis=-1)
    start = jnp.where(any_B, jnp.argmax(allowed_BxS, axis=-1), 0)
    end = jnp.where(any_B, S - jnp.argmax(allowed_BxS[:, ::-1], axis=-1), 1)
    return start.astype(jnp.int32), end.astype(jnp.int32)


def reference(q_BxKxGxH, k_BxKxSxH, v_BxKxSxH, start_B, end_B) -> jax.Array:
    """The same attention in plain JAX, in float32 (the tests' reference)."""
    f32 = jnp.float32
    scores = jnp.einsum("bkgh,bksh->bkgs", q_BxKxGxH.astype(f32), k_BxKxSxH.astype(f32))
    slots = jnp.arange(k_BxKxSxH.shape[2])
    live = (slots >= start_B[:, None]) & (slots < end_B[:, None])
    scores = jnp.where(live[:, None, None], scores / math.sqrt(q_BxKxGxH.shape[-1]), -jnp.inf)
    return jnp.einsum("bkgs,bksh->bkgh", jax.nn.softmax(scores, axis=-1), v_BxKxSxH.astype(f32))


def attend(platform: str, q_BxKxGxH, k_BxKxSxH, v_BxKxSxH, start_B, end_B, interpret: bool = False) -> jax.Array:
    """[B, K, G, H] in q's dtype, by `platform`'s kernel (the CPU's: the TPU kernel's), in Pallas interpret mode
    with `interpret` or on the CPU. Under a mesh each device runs it on its own rows and KV heads (the cache's
    logical axes); the slots and the head dim stay whole."""
    if platform == "gpu":
        kernel = functools.partial(_gpu, interpret=interpret)
    else:
        kernel = functools.partial(_tpu, interpret=interpret or platform != "tpu")
    rows_heads = ("decode_rows", "kv_heads", None, None)
    return sharding.per_shard(kernel, (q_BxKxGxH, k_BxKxSxH, v_BxKxSxH, start_B, end_B),
                              (rows_heads,) * 3 + (("decode_rows",),) * 2, rows_heads)


def _tpu(q_BxKxGxH, k_BxKxSxH, v_BxKxSxH, start_B, end_B, interpret: bool) -> jax.Array:
    from jax.experimental.pallas import tpu as pltpu
    B, K, G, H = q_BxKxGxH.shape
    S = k_BxKxSxH.shape[2]
    block = math.gcd(S, BLOCK) if S % 8 == 0 else S  # the sampler's cache lengths are multiples of 16
    blocks, scale, f32 = S // block, 1.0 / math.sqrt(H), jnp.float32

    def kv_block(b, h, j, start_ref, end_ref):  # integer division by lax.div: Mosaic lowers no floor division
        first = jax.lax.div(start_ref[b], block)
        last = jax.lax.div(jnp.maximum(end_ref[b] - 1, 0), block)
        return b, h, jnp.minimum(jnp.maximum(j, first), last), 0

    def kernel(start_ref, end_ref, q_ref, k_ref, v_ref, o_ref, max_ref, sum_ref, acc_ref):
        b, j = pl.program_id(0), pl.program_id(2)
        start, end, lo = start_ref[b], end_ref[b], j * block

        @pl.when(j == 0)
        def _init():
            max_ref[...] = jnp.full(max_ref.shape, _MASKED, f32)
            sum_ref[...] = jnp.zeros(sum_ref.shape, f32)
            acc_ref[...] = jnp.zeros(acc_ref.shape, f32)

        @pl.when((lo < end) & (lo + block > start))
        def _block():
            s_GxC = jax.lax.dot_general(q_ref[...], k_ref[...], (((1,), (1,)), ((), ())),
                                        preferred_element_type=f32) * scale
            slot = lo + jax.lax.broadcasted_iota(jnp.int32, s_GxC.shape, 1)
            s_GxC = jnp.where((slot >= start) & (slot < end), s_GxC, _MASKED)
            old = max_ref[...]
            new = jnp.maximum(old, jnp.max(s_GxC, axis=1, keepdims=True))
            p_GxC = jnp.exp(s_GxC - new)
            rescale = jnp.exp(old - new)
            sum_ref[...] = rescale * sum_ref[...] + jnp.sum(p_GxC, axis=1, keepdims=True)
            acc_ref[...] = rescale * acc_ref[...] + jax.lax.dot_general(
                p_GxC.astype(v_ref.dtype), v_ref[...], (((1,), (0,)), ((), ())), preferred_element_type=f32)
            max_ref[...] = new

        @pl.when(j == blocks - 1)
        def _out():
            o_ref[...] = (acc_ref[...] / sum_ref[...]).astype(o_ref.dtype)

    per_row = lambda b, h, j, start_ref, end_ref: (b, h, 0, 0)
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(B, K, blocks),
        in_specs=[pl.BlockSpec((None, None, G, H), per_row), pl.BlockSpec((None, None, block, H), kv_block),
                  pl.BlockSpec((None, None, block, H), kv_block)],
        out_specs=pl.BlockSpec((None, None, G, H), per_row),
        scratch_shapes=[pltpu.VMEM((G, 1), f32), pltpu.VMEM((G, 1), f32), pltpu.VMEM((G, H), f32)])
    # XLA's cost analysis sees a kernel only through this estimate: the whole cache, the last decode step's reads
    # (an upper bound; a step reads its rows' live slots)
    itemsize = k_BxKxSxH.dtype.itemsize
    cost = pl.CostEstimate(flops=4 * B * K * G * S * H, transcendentals=B * K * G * S,
                           bytes_accessed=2 * B * K * S * H * itemsize + 2 * B * K * G * H * q_BxKxGxH.dtype.itemsize)
    return pl.pallas_call(kernel, grid_spec=spec, out_shape=jax.ShapeDtypeStruct(q_BxKxGxH.shape, q_BxKxGxH.dtype),
                          interpret=interpret, cost_estimate=cost)(
        start_B.astype(jnp.int32), end_B.astype(jnp.int32), q_BxKxGxH, k_BxKxSxH, v_BxKxSxH)


def _gpu(q_BxKxGxH, k_BxKxSxH, v_BxKxSxH, start_B, end_B, interpret: bool) -> jax.Array:
    from jax.experimental.pallas.ops.gpu import decode_attention
    B, K, G, H = q_BxKxGxH.shape
    S = k_BxKxSxH.shape[2]
    if S % 16:  # Triton's blocks are at least 16 slots (the sampler's caches are multiples of 16: never padded)
        pad = [(0, 0), (0, 0), (0, -S % 16), (0, 0)]
        k_BxKxSxH, v_BxKxSxH, S = jnp.pad(k_BxKxSxH, pad), jnp.pad(v_BxKxSxH, pad), S + (-S % 16)
    block = math.gcd(S, BLOCK)  # both must divide the cache: each split a whole number of blocks
    splits = max(d for d in range(1, min(GPU_SPLITS, S // block) + 1) if (S // block) % d == 0)
    # gqa takes [B, S, K, H] and swaps the axes back: the two transposes cancel in XLA
    out = decode_attention.gqa(q_BxKxGxH.reshape(B, K * G, H), k_BxKxSxH.swapaxes(1, 2), v_BxKxSxH.swapaxes(1, 2),
                               start_idx=start_B, kv_seq_len=end_B, block_k=block, k_splits=splits,
                               interpret=interpret)
    return out.reshape(B, K, G, H).astype(q_BxKxGxH.dtype)
