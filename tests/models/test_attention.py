import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax.models import attention, decoder as model
from tests.tolerances import decoder_terms, f32_tols


def _qkv(B=2, T=40, N=4, K=2, H=8, seed=0, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (B, T, K, H), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (B, T, K, H), jnp.float32).astype(dtype)
    return q, k, v


def _segments(T=40):
    """Row 0: three packed sequences and trailing padding; row 1: one left-padded sequence."""
    row0 = np.array([1] * 13 + [2] * 9 + [3] * 11 + [0] * (T - 33))
    row1 = np.array([0] * 6 + [1] * (T - 6))
    return jnp.asarray(np.stack([row0, row1]), jnp.int32)


@pytest.mark.parametrize("block", [64, 16])
def test_blockwise_equals_naive_values_and_gradients(block):
    q, k, v = _qkv()
    seg = _segments()
    w = jax.random.normal(jax.random.key(9), q.shape)
    real = (seg > 0)[:, :, None, None]  # padding outputs are unspecified beyond being finite

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.where(real, jnp.sin(fn(q, k, v, seg)) * w, 0.0))

    got = attention.blockwise(q, k, v, seg, block=block)
    ref = attention.naive(q, k, v, seg)
    assert np.all(np.isfinite(got))
    # tiles vs one softmax: q.k over H, the normaliser and weighted sum over T positions; outputs near 0 average v ~ 1
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, ref, 0),
                               **f32_tols(q.shape[3] + 2 * q.shape[1], floor=1.0))
    g_got = jax.grad(loss(lambda *a: attention.blockwise(*a, block=block)), argnums=(0, 1, 2))(q, k, v)
    g_ref = jax.grad(loss(attention.naive), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_got, g_ref):  # the backward adds one more sum over T; gradients near 0: floor at their size
        np.testing.assert_allclose(a, b, **f32_tols(q.shape[3] + 3 * q.shape[1], floor=np.abs(b).max()))


def test_row_groups_fit_the_budget_and_divide_the_rows():
    per_row = 4 * 8 * 160 * 160  # fp32 scores of one row: 8 heads, 160 positions
    assert attention.row_groups(64, 8, 160, 160, 5 << 20) == 16  # 4 rows a group: 3.1 MiB; 8 would take 6.3
    assert attention.row_groups(64, 8, 160, 160, 64 * per_row) == 1
    assert attention.row_groups(6, 8, 160, 160, 4 * per_row) == 2  # 4 rows would fit, but 6 splits as 3 + 3
    assert attention.row_groups(7, 8, 160, 160, 4 * per_row) == 7
    assert attention.row_groups(4, 8, 160, 160, per_row // 2) == 4  # even one row over: one at a time


@pytest.mark.parametrize("groups", [2, 3])
def test_naive_in_groups_equals_naive_values_and_gradients(groups):
    """Rows in groups of consecutive rows, one group after another: the same values and gradients as all at once."""
    seg = jnp.concatenate([_segments()] * 3)
    q, k, v = _qkv(B=6)
    w = jax.random.normal(jax.random.key(3), q.shape)
    loss = lambda fn: (lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v, seg)) * w))
    grouped = lambda *a: attention.naive_in_groups(*a, groups)
    np.testing.assert_allclose(grouped(q, k, v, seg), attention.naive(q, k, v, seg), rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.grad(loss(grouped), argnums=(0, 1, 2))(q, k, v),
                    jax.grad(loss(attention.naive), argnums=(0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_attend_groups_rows_on_one_cpu_device_only(monkeypatch):
    """On XLA:CPU, one device, naive attention runs in row groups within CPU_SCORES_BYTES; on a simulated mesh of
    several devices (rows split) and for other platforms' programs (the plan's TPU ones), all rows at once."""
    calls = []
    monkeypatch.setattr(attention, "naive_in_groups", lambda *a: calls.append(a[-1]) or attention.naive(*a[:-1]))
    monkeypatch.setattr(attention, "CPU_SCORES_BYTES", 4 * 4 * 40 * 40)  # one row's scores (4 heads, 40 positions)
    q, k, v = _qkv()
    attention.attend("naive", q, k, v, _segments())
    on_cpu = [2] if jax.default_backend() == "cpu" else []
    assert calls == on_cpu
    for target in (("cpu", 8), ("tpu", 1)):
        monkeypatch.setattr(attention, "_target", lambda: target)
        attention.attend("naive", q, k, v, _segments())
        assert calls == on_cpu, target


def test_target_platform_is_the_meshs():
    assert attention._target() == (jax.default_backend(), 1)
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        assert attention._target() == (jax.devices()[0].platform, 1)


def test_tile_ranges_skip_tiles_between_sequences():
    # block 4: row 0 = sequences [0, 6), [6, 9), [9, 16), then padding; row 1 = [0, 10), [10, 20), padding
    seg = jnp.asarray([[1] * 6 + [2] * 3 + [3] * 7 + [0] * 8, [1] * 10 + [2] * 10 + [0] * 4], jnp.int32)
    first, last = attention.tile_ranges(seg, 4)
    # query tile 2 (8..11): row 0's token 8 starts at 6 (tile 1), row 1's token 8 at 0 (tile 0)
    # padding attends to itself only: query tile 5 (20..23) is padding in both rows
    np.testing.assert_array_equal(first, [0, 0, 0, 2, 2, 5])
    # key tile 0 (0..3): row 1's sequence runs to 9 (tile 2); key tile 4 is row 1's sequence 2 (to 19) or padding
    np.testing.assert_array_equal(last, [2, 2, 4, 4, 4, 5])


def _assert_blockwise_equals_naive(q, k, v, seg, w, block: int) -> None:
    """Outputs and gradients (of a w-weighted loss) of blockwise attention equal naive attention on real tokens."""
    real = (seg > 0)[:, :, None, None]
    loss = lambda fn: lambda q, k, v: jnp.sum(jnp.where(real, jnp.sin(fn(q, k, v, seg)) * w, 0.0))
    blocked = lambda *a: attention.blockwise(*a, block=block)
    # as in test_blockwise_equals_naive_values_and_gradients: H + 2 T terms forward, one more T backward
    np.testing.assert_allclose(np.where(real, blocked(q, k, v, seg), 0),
                               np.where(real, attention.naive(q, k, v, seg), 0),
                               **f32_tols(q.shape[3] + 2 * q.shape[1], floor=1.0))
    for a, b in zip(jax.grad(loss(blocked), argnums=(0, 1, 2))(q, k, v),
                    jax.grad(loss(attention.naive), argnums=(0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(a, b, **f32_tols(q.shape[3] + 3 * q.shape[1], floor=np.abs(b).max()))


def test_blockwise_equals_naive_for_non_contiguous_segment_ids():
    """ids [1]*64 + [0]*128 + [1]*64: the last 64 tokens attend back to the first 64, across the padding."""
    T = 256
    seg = jnp.asarray(np.stack([[1] * 64 + [0] * 128 + [1] * 64, [2] * 100 + [1] * 56 + [2] * 100]), jnp.int32)
    first, last = attention.tile_ranges(seg, 64)
    np.testing.assert_array_equal(first, [0, 0, 0, 0])
    np.testing.assert_array_equal(last, [3, 3, 3, 3])
    q, k, v = _qkv(T=T, seed=7)
    w = jax.random.normal(jax.random.key(8), q.shape)
    _assert_blockwise_equals_naive(q, k, v, seg, w, block=64)


def test_blockwise_equals_naive_where_tiles_are_skipped():
    """Two rows of short packed sequences and small tiles: tiles far below the diagonal are dead in both rows."""
    T = 48
    rng = np.random.default_rng(3)
    rows = []
    for _ in range(2):
        lens = rng.integers(3, 9, 12)
        ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lens)])[:T - 5]
        rows.append(np.pad(ids, (0, T - len(ids))))
    seg = jnp.asarray(np.stack(rows), jnp.int32)
    first, _ = attention.tile_ranges(seg, 8)
    n = len(first)
    visited = int(np.sum(np.arange(n) - np.asarray(first) + 1))
    assert visited <= 2 * n - 1 < n * (n + 1) // 2  # the diagonal and at most one tile below it, not all causal ones
    q, k, v = _qkv(T=T, seed=4)
    w = jax.random.normal(jax.random.key(5), q.shape)
    _assert_blockwise_equals_naive(q, k, v, seg, w, block=8)


def test_segments_do_not_see_each_other():
    """Changing sequence 1's tokens leaves sequence 2's outputs unchanged (and vice versa for later ones)."""
    q, k, v = _qkv()
    seg = _segments()
    k2 = k.at[0, :13].set(-k[0, :13])
    v2 = v.at[0, :13].set(3.0)
    for fn in (attention.naive, lambda *a: attention.blockwise(*a, block=16)):
        a, b = fn(q, k, v, seg), fn(q, k2, v2, seg)
        np.testing.assert_allclose(a[0, 13:33], b[0, 13:33], atol=1e-6)
        assert not np.allclose(a[0, :13], b[0, :13])


def test_segment_positions_restart_per_segment():
    pos = attention.segment_positions(jnp.asarray([[1, 1, 1, 2, 2, 0, 0], [0, 0, 1, 1, 1, 1, 1]]))
    np.testing.assert_array_equal(pos, [[0, 1, 2, 0, 1, 0, 1], [0, 1, 0, 1, 2, 3, 4]])


def test_block_size_keeps_padding_small():
    assert attention.block_size(1024) == 512
    assert attention.block_size(544) == 64  # 512 / 256 / 128 would pad more than an eighth
    assert attention.block_size(640) == 128
    assert attention.block_size(40) == 64


def test_resolve_falls_back_and_rejects_unknown():
    assert attention.resolve("naive", 8192, jnp.float32) == "naive"
    if jax.default_backend() == "cpu":
        assert attention.resolve("cudnn", 128, jnp.bfloat16) == "blockwise"
        assert attention.resolve("splash", 128, jnp.bfloat16) == "blockwise"
        assert attention.resolve("auto", 128, jnp.float32) == "naive"
        assert attention.resolve("auto", 640, jnp.float32) == "blockwise"
        assert attention.resolve("auto", 4096, jnp.float32) == "blockwise"
    with pytest.raises(ValueError, match="model.attention"):
        attention.resolve("flash9", 128, jnp.float32)
    with pytest.raises(ValueError, match="model.attention"):
        model.preset("tiny", attention="flash9")


def test_splash_interpret_matches_naive():
    """The TPU kernel's wiring (head layout, scale, segment ids, padding) in Pallas interpret mode on CPU."""
    pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention")
    T = 128
    q, k, v = _qkv(T=T, H=128)
    seg = jnp.asarray(np.stack([[1] * 50 + [2] * 60 + [0] * 18, [0] * 20 + [1] * 108]), jnp.int32)
    try:
        got = attention.splash(q, k, v, seg, block=128, interpret=True)
    except Exception as e:  # noqa: BLE001 - interpret mode of a TPU kernel is best effort off TPU
        pytest.skip(f"splash interpret mode unavailable here: {type(e).__name__}: {str(e)[:200]}")
    real = (seg > 0)[:, :, None, None]
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, attention.naive(q, k, v, seg), 0),
                               **f32_tols(q.shape[3] + 2 * q.shape[1], floor=1.0))  # as the blockwise test


@pytest.mark.parametrize("impl", ["naive", "blockwise"])
def test_model_logprobs_agree_across_implementations(impl):
    cfg = model.preset("tiny", attention="naive", attention_block=64)
    params = model.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (2, 96)), jnp.int32)
    mask = jnp.asarray(np.arange(96)[None] >= np.array([[0], [30]]), jnp.int32)
    targets = jnp.roll(tokens, -1, axis=1)
    ref = model.logprobs_and_entropy(cfg, params, tokens, targets, mask_BxT=mask)
    got = model.logprobs_and_entropy(cfg.replace(attention=impl), params, tokens, targets, mask_BxT=mask)
    real = np.asarray(mask, bool)
    for a, b in zip(got, ref):  # log-probs and entropies through the model, of order 1 (tests/tolerances.py)
        np.testing.assert_allclose(np.where(real, a, 0), np.where(real, b, 0),
                                   **f32_tols(decoder_terms(cfg, 96), floor=1.0))


def test_splash_interpret_under_a_mesh_matches_naive():
    """On a mesh the kernel runs per shard (rows over data x fsdp); still the naive result."""
    pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention")
    from sage_jax.models import sharding
    mesh = sharding.make_mesh((2, 1, 1), jax.devices()[:2])
    q, k, v = _qkv(T=128, H=128)
    seg = jnp.asarray(np.stack([[1] * 50 + [2] * 60 + [0] * 18, [0] * 20 + [1] * 108]), jnp.int32)
    with jax.set_mesh(mesh):
        got = jax.jit(lambda *a: attention.splash(*a, block=128, interpret=True))(q, k, v, seg)
    real = (seg > 0)[:, :, None, None]
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, attention.naive(q, k, v, seg), 0),
                               **f32_tols(q.shape[3] + 2 * q.shape[1], floor=1.0))


def test_a_kernel_that_cannot_trace_falls_back_to_blockwise(monkeypatch):
    monkeypatch.setattr(attention, "resolve", lambda impl, *_: impl)  # pretend we are on the accelerator

    def unsupported(*_):
        raise NotImplementedError("no such kernel here")
    monkeypatch.setattr(attention, "cudnn", unsupported)
    q, k, v = _qkv()
    seg = _segments()
    np.testing.assert_allclose(attention.attend("cudnn", q, k, v, seg, block=16),
                               attention.blockwise(q, k, v, seg, block=16), atol=1e-6)


def test_xla_cpu_takes_blockwise_tiles_of_at_most_cpu_tile(monkeypatch):
    """On CPU the configured tile (model.attention_block, 512 by default: splash's on TPU) is capped at CPU_TILE:
    512-tiles ran the same work 2-2.8x slower there. Elsewhere the configured tile stands."""
    seen = []
    monkeypatch.setattr(attention, "blockwise", lambda *a: seen.append(a[-1]) or a[0])
    q, k, v = _qkv(T=300)
    seg = jnp.ones((2, 300), jnp.int32)
    attention.attend("blockwise", q, k, v, seg, block=512)
    attention.attend("blockwise", q, k, v, seg, block=64)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    attention.attend("blockwise", q, k, v, seg, block=512)
    assert seen == [attention.CPU_TILE, 64, 512] and attention.CPU_TILE == 128


@pytest.mark.parametrize("layer", [None, 1])
def test_decode_attention_by_position_groups_equals_one_batch(layer):
    """The blocked decode attention (XLA:CPU's decode form) runs rows sorted by how far they read, in
    DecodeForms.position_groups groups each to its own furthest row: per row the same as one batch read to the
    furthest row of all (the blocks past a row's own last slot leave it as it is; up to the rounding of a batch of
    another size), and as a plain softmax over its allowed slots."""
    import dataclasses
    from sage_jax.models import decode_forms, kv_cache
    cpu = decode_forms.for_platform("cpu")
    assert cpu.attention == "blocked" and cpu.position_groups == 4
    B, N, K, S, H, L = 16, 4, 2, 320, 8, 3
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (B, 1, N, H))
    shape = (B, L, K, S, H) if layer is not None else (B, K, S, H)
    k_cache, v_cache = (jax.random.normal(k, shape) for k in ks[1:])
    reads = np.array([5, 300, 64, 65, 1, 128, 200, 250, 17, 320, 90, 33, 150, 260, 70, 2])  # slots each row reads
    allowed = jnp.asarray(np.arange(S)[None, None, :] < reads[:, None, None])
    run = lambda forms: np.asarray(jax.jit(lambda q, k, v, a: kv_cache.cached_attention(
        q, k, v, a, layer=layer, forms=forms))(q, k_cache, v_cache, allowed))
    grouped, one = run(cpu), run(dataclasses.replace(cpu, position_groups=1))
    np.testing.assert_allclose(grouped, one, rtol=1e-6, atol=1e-6)
    kk = k_cache[:, layer] if layer is not None else k_cache
    vv = v_cache[:, layer] if layer is not None else v_cache
    qq = q[:, 0].reshape(B, K, N // K, H)
    scores = jnp.einsum("bkgh,bksh->bkgs", qq, kk) / np.sqrt(H)
    probs = jax.nn.softmax(jnp.where(allowed[:, :, None], scores, -jnp.inf), axis=-1)
    ref = jnp.einsum("bkgs,bksh->bkgh", probs, vv).reshape(B, 1, N, H)
    np.testing.assert_allclose(grouped, np.asarray(ref), rtol=1e-5, atol=1e-5)
