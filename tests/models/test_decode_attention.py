"""The decode forms per platform (models.decode_forms) and the per-row-length Pallas kernels (models.decode_attention),
checked against the reference attention in Pallas interpret mode on the CPU."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax.models import decode_attention, decode_forms, kv_cache


def test_one_table_says_which_forms_each_platform_gets():
    cpu, tpu, gpu = (decode_forms.for_platform(p) for p in ("cpu", "tpu", "cuda"))
    assert (cpu.scores, cpu.stacked_cache, cpu.attention, cpu.cache_bits) == ("multiply_sum", True, "blocked", True)
    for forms in (tpu, gpu):  # the matrix units, no stacked cache read at a loop-variable layer, live rows only
        assert (forms.scores, forms.stacked_cache, forms.attention, forms.unstack_layers, forms.shrink,
                forms.cache_bits) == ("matmul", False, "kernel", False, False, False)
    assert gpu.platform == "gpu" and gpu.steps_per_loop > 1 and tpu.steps_per_loop == cpu.steps_per_loop == 1
    # a forced form keeps the rest of the platform's; without the kernel the pool shrinks again
    forced = decode_forms.for_platform("tpu", "one_pass")
    assert forced.attention == "one_pass" and forced.shrink and forced.scores == "matmul"
    assert decode_forms.for_platform("cpu", "kernel").interpret
    # XLA:CPU reads a short cache in one pass, a longer one in blocks; other platforms keep their kernel
    limit = decode_forms.CPU_ONE_PASS_MAX_POSITIONS
    assert decode_forms.for_platform("cpu", cache_positions=limit).attention == "one_pass"
    assert decode_forms.for_platform("cpu", cache_positions=limit + 1) == cpu
    assert decode_forms.for_platform("cpu", "blocked", cache_positions=64).attention == "blocked"
    assert decode_forms.for_platform("tpu", cache_positions=64) == tpu
    with pytest.raises(ValueError, match="decode attention 'flash'"):
        decode_forms.for_platform("tpu", "flash")


def test_live_range_of_each_row():
    allowed = np.zeros((4, 10), bool)
    allowed[0, 3:7] = True
    allowed[1, 0] = True
    allowed[2, 9] = True
    start, end = decode_attention.live_range(jnp.asarray(allowed))
    assert start.tolist() == [3, 0, 9, 0] and end.tolist() == [7, 1, 10, 1]  # a row with none: slot 0 only


def _case(B, K, G, S, H, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, K, G, H), jnp.float32).astype(dtype)
    k, v = (jax.random.normal(k_, (B, K, S, H), jnp.float32).astype(dtype) for k_ in ks[1:])
    # left padding (starts past 0), rows at different positions, a row of one slot, a row to the very end
    rng = np.random.default_rng(seed)
    start = rng.integers(0, S // 3, B)
    end = np.minimum(S, start + 1 + rng.integers(0, S, B))
    start[0], end[0] = 5, 6
    end[-1] = S
    return q, k, v, jnp.asarray(start, jnp.int32), jnp.asarray(end, jnp.int32)


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
def test_kernels_equal_the_reference_attention(platform, dtype, tol):
    """GQA (G = 4 query heads per KV head), left padding, rows at different positions, in interpret mode."""
    q, k, v, start, end = _case(B=6, K=2, G=4, S=288, H=64, dtype=dtype)
    got = decode_attention.attend(platform, q, k, v, start, end, interpret=True)
    assert got.dtype == dtype and got.shape == q.shape
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(decode_attention.reference(q, k, v, start, end)),
                               atol=tol, rtol=tol)


def test_tpu_kernel_reads_nothing_outside_a_rows_range():
    """Slots outside [start, end) may hold anything finite (a refilled slot holds its last row's entries): they do not
    change a row's result (a block with no live slot is not even computed)."""
    q, k, v, start, end = _case(B=3, K=1, G=2, S=256, H=8, dtype=jnp.float32, seed=1)
    slots = np.arange(256)
    outside = (slots[None] < np.asarray(start)[:, None]) | (slots[None] >= np.asarray(end)[:, None])
    poison = lambda a: jnp.where(jnp.asarray(outside)[:, None, :, None], 1e4, a)
    got = decode_attention.attend("tpu", q, poison(k), poison(v), start, end, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(decode_attention.reference(q, k, v, start, end)),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_cached_attention_in_each_platforms_forms_equals_the_cpus(platform):
    """kv_cache.cached_attention with a platform's whole forms (matmul scores, per-layer cache, the kernel) against
    XLA:CPU's blocked multiply-and-sum, on one query per row under the sampler's masks (prompt left-padded, then
    the tokens so far)."""
    B, N, K, S, H = 5, 4, 2, 200, 16
    ks = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(ks[0], (B, 1, N, H))
    k, v = (jax.random.normal(k_, (B, K, S, H)) for k_ in ks[1:])
    first, last = np.array([3, 0, 10, 7, 0]), np.array([40, 199, 64, 150, 0])
    slots = np.arange(S)
    allowed = jnp.asarray((slots[None] >= first[:, None]) & (slots[None] <= last[:, None]))[:, None]
    cpu = kv_cache.cached_attention(q, k, v, allowed, forms=decode_forms.for_platform("cpu"))
    other = kv_cache.cached_attention(q, k, v, allowed, forms=decode_forms.emulated(platform))
    np.testing.assert_allclose(np.asarray(other), np.asarray(cpu), atol=2e-5, rtol=2e-5)
    one_pass = kv_cache.cached_attention(q, k, v, allowed, forms=dataclasses.replace(
        decode_forms.emulated(platform), attention="one_pass"))
    np.testing.assert_allclose(np.asarray(one_pass), np.asarray(cpu), atol=2e-5, rtol=2e-5)
