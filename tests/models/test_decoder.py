import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax.models import decoder as model, rope, sharding
from tests.tolerances import decoder_terms, f32_tols

CFG = model.preset("tiny", vocab_size=256, num_layers=2)
# Logits, log-probs and entropies of CFG (order 1 here: the floor) along other reduction orders: chunks, a KV cache,
# left padding, another layer loop, a mesh; at most 16 positions. rtol = 4.3e-5 (tests/tolerances.py), 2e-4 at 4;
# a KV-cache step one position off moves every logit, by 0.12 in the median (measured), over 500x that.
TOLS = f32_tols(decoder_terms(CFG, 16), floor=1.0)


def _batch(cfg, B=3, T=12, seed=0):
    rng = np.random.RandomState(seed)
    tokens = rng.randint(0, cfg.vocab_size, (B, T)).astype(np.int32)
    mask = np.ones((B, T), np.int32)
    for row, pad in zip(range(1, B), (4, 7)):
        mask[row, :pad] = 0
    return jnp.asarray(tokens), jnp.asarray(mask)


@pytest.fixture(scope="module")
def params():
    return model.init_params(CFG, jax.random.key(0), std=0.1)


def _reference_logprobs(cfg, params, tokens, mask, temperature):
    logits = model.forward(cfg, params, tokens, mask_BxT=mask) / temperature
    logp_all = jax.nn.log_softmax(logits, -1)
    targets = jnp.roll(tokens, -1, axis=1)
    logp = jnp.take_along_axis(logp_all, targets[..., None], -1)[..., 0]
    ent = -jnp.sum(jnp.exp(logp_all) * logp_all, -1)
    return logp, ent


@pytest.mark.parametrize("chunk", [1, 5, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_logprobs_match_unchunked(params, chunk, temperature):
    tokens, mask = _batch(CFG)
    targets = jnp.roll(tokens, -1, axis=1)
    logp, ent = model.logprobs_and_entropy(CFG, params, tokens, targets, mask_BxT=mask, temperature=temperature,
                                           chunk=chunk)
    ref_logp, ref_ent = _reference_logprobs(CFG, params, tokens, mask, temperature)
    np.testing.assert_allclose(logp, ref_logp, **TOLS)
    np.testing.assert_allclose(ent, ref_ent, **TOLS)


def test_logprobs_window_and_gradient(params):
    tokens, mask = _batch(CFG)
    targets = jnp.roll(tokens, -1, axis=1)
    logp, _ = model.logprobs_and_entropy(CFG, params, tokens, targets, mask_BxT=mask, start=5, length=4, chunk=3)
    ref_logp, _ = _reference_logprobs(CFG, params, tokens, mask, 1.0)
    np.testing.assert_allclose(logp, ref_logp[:, 5:9], **TOLS)

    def f(p, chunk):
        return model.logprobs_and_entropy(CFG, p, tokens, targets, mask_BxT=mask, chunk=chunk)[0].sum()
    g_chunked = jax.grad(f)(params, 4)
    g_full = jax.grad(f)(params, 64)
    for a, b in zip(jax.tree.leaves(g_chunked), jax.tree.leaves(g_full)):  # + a weight's sum over the B x T positions
        np.testing.assert_allclose(a, b, **f32_tols(decoder_terms(CFG, 16) + tokens.size, floor=np.abs(b).max()))


def test_bf16_compute_close_to_fp32(params):
    tokens, mask = _batch(CFG)
    targets = jnp.roll(tokens, -1, axis=1)
    cfg16 = CFG.replace(compute_dtype="bfloat16")
    logp16, ent16 = model.logprobs_and_entropy(cfg16, params, tokens, targets, mask_BxT=mask)
    logp32, ent32 = model.logprobs_and_entropy(CFG, params, tokens, targets, mask_BxT=mask)
    assert logp16.dtype == jnp.float32
    # Stated tolerance for bf16 matmuls on this tiny model: 0.05 nats.
    np.testing.assert_allclose(logp16, logp32, atol=5e-2)
    np.testing.assert_allclose(ent16, ent32, atol=5e-2)


def test_scan_loop_and_remat_agree(params):
    tokens, mask = _batch(CFG)
    ref = model.forward(CFG, params, tokens, mask_BxT=mask)
    for cfg in (CFG.replace(scan_layers=False), CFG.replace(remat=True)):
        np.testing.assert_allclose(model.forward(cfg, params, tokens, mask_BxT=mask), ref, **TOLS)


def test_layer_checkpointing_keeps_the_gradients(params):
    """hidden() checkpoints each layer (remat or not); its gradients equal plain autodiff through the same layers."""
    tokens, mask = _batch(CFG)
    positions = model.default_positions(mask)
    T = tokens.shape[1]
    allowed = (jnp.tril(jnp.ones((T, T), bool))[None] & mask.astype(bool)[:, None, :]) | jnp.eye(T, dtype=bool)[None]

    def plain(p):  # no jax.checkpoint anywhere: autodiff keeps every intermediate
        x = model._embed(CFG, p, tokens)
        for i in range(CFG.num_layers):
            x = model._block(CFG, jax.tree.map(lambda a: a[i], p["layers"]), x, positions, allowed)[0]
        return jnp.sum(jnp.sin(model.rms_norm(x, p["final_norm"], CFG.rms_norm_eps)))

    ref = jax.grad(plain)(params)
    for cfg in (CFG, CFG.replace(remat=True), CFG.replace(scan_layers=False)):
        got = jax.grad(lambda p: jnp.sum(jnp.sin(model.hidden(cfg, p, tokens, mask_BxT=mask))))(params)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):  # float re-association only
            np.testing.assert_allclose(a, b, **f32_tols(decoder_terms(CFG, 16) + tokens.size, floor=np.abs(b).max()))


def test_left_padding_does_not_change_real_logits(params):
    tokens, _ = _batch(CFG, B=1, T=8)
    padded = jnp.concatenate([jnp.zeros((1, 5), jnp.int32), tokens], axis=1)
    mask = jnp.concatenate([jnp.zeros((1, 5), jnp.int32), jnp.ones((1, 8), jnp.int32)], axis=1)
    a = model.forward(CFG, params, tokens)
    b = model.forward(CFG, params, padded, mask_BxT=mask)[:, 5:]
    np.testing.assert_allclose(a, b, **TOLS)


def test_kv_cache_prefill_then_step_matches_full_forward(params):
    tokens, mask = _batch(CFG, T=10)
    full = model.forward(CFG, params, tokens, mask_BxT=mask)
    positions = model.default_positions(mask)
    cache = model.init_cache(CFG, 3, 16)
    kv_mask = jnp.pad(mask, ((0, 0), (0, 6)))
    kv_mask = kv_mask.at[:, 9].set(0)
    logits, cache = model.forward_with_cache(CFG, params, tokens[:, :9], positions[:, :9], cache, 0, kv_mask)
    np.testing.assert_allclose(logits, full[:, :9], **TOLS)
    kv_mask = kv_mask.at[:, 9].set(1)
    step, _ = model.forward_with_cache(CFG, params, tokens[:, 9:10], positions[:, 9:10], cache, 9, kv_mask)
    np.testing.assert_allclose(step[:, 0], full[:, 9], **TOLS)


QWEN3_YARN = CFG.replace(architecture="qwen3", qkv_bias=False, qk_norm=True, head_dim=16, rope_scaling=(
    ("factor", 4.0), ("original_max_position_embeddings", 8), ("rope_type", "yarn")))


def test_kv_cache_matches_full_forward_with_qk_norm_and_rope_scaling():
    p = model.init_params(QWEN3_YARN, jax.random.key(2), std=0.1)
    p["layers"]["q_norm"] = 1 + 0.3 * jax.random.normal(jax.random.key(3), p["layers"]["q_norm"].shape)
    tokens, mask = _batch(QWEN3_YARN, T=10)
    full = model.forward(QWEN3_YARN, p, tokens, mask_BxT=mask)
    positions = model.default_positions(mask)
    kv_mask = jnp.pad(mask, ((0, 0), (0, 6))).at[:, 9].set(0)
    _, cache = model.forward_with_cache(QWEN3_YARN, p, tokens[:, :9], positions[:, :9],
                                        model.init_cache(QWEN3_YARN, 3, 16), 0, kv_mask)
    step, _ = model.forward_with_cache(QWEN3_YARN, p, tokens[:, 9:10], positions[:, 9:10], cache, 9,
                                       kv_mask.at[:, 9].set(1))
    np.testing.assert_allclose(step[:, 0], full[:, 9], **TOLS)
    plain = model.forward(QWEN3_YARN.replace(rope_scaling=()), p, tokens, mask_BxT=mask)
    assert float(jnp.abs(plain - full).max()) > 1e-3


def test_rope_scaling_variants():
    x = jax.random.normal(jax.random.key(0), (1, 6, 2, 16))
    pos = jnp.arange(6)[None] * 7
    plain = model.rope_frequencies(CFG.replace(head_dim=16))
    linear = model.rope_frequencies(CFG.replace(head_dim=16, rope_scaling=(("factor", 4.0), ("rope_type", "linear"))))
    # linear scaling is plain RoPE at positions / factor
    np.testing.assert_allclose(rope.apply(x, pos, *linear), rope.apply(x, pos / 4.0, *plain), atol=1e-5)
    llama3 = CFG.replace(head_dim=16, rope_theta=5e5, rope_scaling=(
        ("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
        ("original_max_position_embeddings", 64), ("rope_type", "llama3")))
    inv, scale = model.rope_frequencies(llama3)
    inv0, _ = model.rope_frequencies(llama3.replace(rope_scaling=()))
    wavelen = 2 * np.pi / inv0
    assert scale == 1.0
    np.testing.assert_array_equal(inv[wavelen < 16], inv0[wavelen < 16])  # high frequencies kept
    np.testing.assert_allclose(inv[wavelen > 64], inv0[wavelen > 64] / 8, rtol=1e-6)  # low ones divided by factor
    _, yarn_scale = model.rope_frequencies(QWEN3_YARN)
    assert np.isclose(yarn_scale, 0.1 * np.log(4.0) + 1)
    with pytest.raises(ValueError, match="rope_type='dynamic'"):
        model.rope_frequencies(CFG.replace(rope_scaling=(("factor", 2.0), ("rope_type", "dynamic"))))


def test_qwen3_preset_size():
    cfg = model.preset("qwen3-4b")
    assert (cfg.qk_norm, cfg.qkv_bias, cfg.head_dim, cfg.num_heads * cfg.head_dim) == (True, False, 128, 4096)
    assert round(cfg.num_params / 1e9, 2) == 4.02  # Qwen3-4B's model card: 4.0B


def test_param_axes_cover_every_param():
    for cfg in (CFG, CFG.replace(tie_embeddings=False, qkv_bias=False), QWEN3_YARN):
        p = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
        axes = model.param_axes(cfg)
        is_axes = lambda x: isinstance(x, tuple)
        assert jax.tree.structure(p) == jax.tree.structure(axes, is_leaf=is_axes)
        for leaf, ax in zip(jax.tree.leaves(p), jax.tree.leaves(axes, is_leaf=is_axes)):
            assert len(leaf.shape) == len(ax)
        assert sum(x.size for x in jax.tree.leaves(p)) == cfg.num_params


def test_sharded_forward_equals_single_device(params):
    assert len(jax.devices()) == 8
    mesh = sharding.make_mesh((1, 2, 4))
    cfg = CFG.replace(num_kv_heads=4)
    p = model.init_params(cfg, jax.random.key(1), std=0.1)
    tokens, mask = _batch(cfg, B=4)
    ref = model.forward(cfg, p, tokens, mask_BxT=mask)
    sp = model.shard_params(p, mesh, cfg=cfg)
    assert sp["layers"]["wq"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    assert len(sp["layers"]["wq"].addressable_shards) == 8
    with jax.set_mesh(mesh):
        out = jax.jit(lambda p, t, m: model.forward(cfg, p, t, mask_BxT=m))(
            sp, jax.device_put(tokens, sharding.data_sharding(mesh, 2)), mask)
    np.testing.assert_allclose(out, ref, **TOLS)


def test_mesh_errors():
    with pytest.raises(ValueError, match="needs 6 devices but 8"):
        sharding.make_mesh((1, 3, 2))
    with pytest.raises(ValueError, match="do not divide"):
        sharding.make_mesh((3, -1, 1))
    with pytest.raises(ValueError, match="at most one"):
        sharding.make_mesh((-1, -1, 1))
    mesh = sharding.make_mesh((1, 8, 1))
    cfg = CFG.replace(hidden_size=132, head_dim=33 - 1)  # 132 does not divide over fsdp=8
    with pytest.raises(ValueError, match="does not divide over mesh axes"):
        model.param_shardings(cfg, mesh)


def test_config_validation():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        CFG.replace(num_heads=3)
    with pytest.raises(ValueError, match="unknown model preset"):
        model.preset("nope")
