import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sage_jax.models import sharding


def test_resolve_mesh_shape_fills_one_free_axis_and_names_the_fix():
    assert sharding.resolve_mesh_shape((1, -1, 2), 8) == (1, 4, 2)
    assert sharding.resolve_mesh_shape((2, 2, 2), 8) == (2, 2, 2)
    with pytest.raises(ValueError, match="do not divide the 8 available"):
        sharding.resolve_mesh_shape((3, -1, 1), 8)
    with pytest.raises(ValueError, match="needs 4 devices but 8 are available"):
        sharding.resolve_mesh_shape((1, 2, 2), 8)
    with pytest.raises(ValueError, match="3 entries"):
        sharding.resolve_mesh_shape((8,), 8)
    with pytest.raises(ValueError, match="positive or -1"):
        sharding.resolve_mesh_shape((0, -1, 1), 8)


def test_make_mesh_axes_are_auto_on_purpose():
    mesh = sharding.make_mesh((2, -1, 2))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert set(mesh.axis_types) == {jax.sharding.AxisType.Auto}


def test_logical_to_spec_uses_each_mesh_axis_once():
    rules = {"batch": ("data", "fsdp"), "embed": "fsdp", "mlp": "tensor", "seq": None}
    assert sharding.logical_to_spec(("batch", "seq", "mlp"), rules) == P(("data", "fsdp"), None, "tensor")
    # "embed" wants fsdp, which "batch" already took: that dimension stays replicated
    assert sharding.logical_to_spec(("batch", "embed"), rules) == P(("data", "fsdp"), None)
    assert sharding.logical_to_spec((None, "unknown"), rules) == P(None, None)


def test_tree_shardings_rejects_a_dimension_that_does_not_divide():
    mesh = sharding.make_mesh((1, 8, 1))
    tree = {"w": jax.ShapeDtypeStruct((16, 6), jnp.float32)}
    ok = sharding.tree_shardings(tree, {"w": ("embed", "mlp")}, mesh)
    assert ok["w"].spec == P("fsdp", "tensor")
    with pytest.raises(ValueError, match=r"\['w'\]: dimension 0 has size 6.*config.mesh.shape"):
        sharding.tree_shardings({"w": jax.ShapeDtypeStruct((6, 16), jnp.float32)}, {"w": ("embed", "mlp")}, mesh)


def test_constrain_is_a_no_op_without_a_mesh_and_skips_shapes_it_cannot_honour():
    x = jnp.ones((3, 4))
    assert sharding.constrain(x, ("batch", None)) is x
    mesh = sharding.make_mesh((1, 8, 1))
    with jax.set_mesh(mesh):
        y = jax.jit(lambda a: sharding.constrain(a, ("batch", None)))(jnp.ones((8, 4)))
        assert y.sharding.is_equivalent_to(sharding.data_sharding(mesh, 2), 2)
        odd = jax.jit(lambda a: sharding.constrain(a, ("batch", None)))(x)  # 3 rows over 8 devices: left alone
        assert odd.shape == (3, 4)


def test_rules_context_overrides_the_default_table():
    mesh = sharding.make_mesh((1, 8, 1))
    with jax.set_mesh(mesh), sharding.use_rules({"batch": None}):
        y = jax.jit(lambda a: sharding.constrain(a, ("batch", None)))(jnp.ones((8, 4)))
    assert y.sharding.is_fully_replicated


def test_global_batch_rows_and_host_round_trip_on_one_process():
    mesh = sharding.make_mesh((2, 4, 1))
    rows = np.arange(32, dtype=np.int32).reshape(8, 4)
    assert sharding.local_rows(8) == slice(0, 8)
    arr = sharding.global_batch(rows, mesh)
    assert arr.sharding.spec == P(("data", "fsdp"), None)
    assert len(arr.addressable_shards) == 8
    np.testing.assert_array_equal(sharding.to_host({"a": arr})["a"], rows)
    np.testing.assert_array_equal(sharding.allgather_rows(rows), rows)
    assert sharding.data_sharding(mesh, 3).spec == P(("data", "fsdp"), None, None)
    assert sharding.replicated(mesh).is_fully_replicated


def test_decode_rules_keep_the_weights_where_they_lie():
    """A decode step on TPU/GPU (DecodeForms.stationary_weights): token activations split their embed dim over the
    weights' embed axes and leave those axes off their rows, so no weight is gathered; the cache, attention and
    logits keep the rows split as "batch" was ("decode_rows")."""
    rules = sharding.decode_rules(rules=sharding.DEFAULT_RULES)
    assert rules["batch"] == ("data",) and rules["act_embed"] == "fsdp" and rules["decode_rows"] == ("data", "fsdp")
    assert {k: v for k, v in rules.items() if k not in ("batch", "act_embed", "decode_rows")} == \
        {k: v for k, v in sharding.DEFAULT_RULES.items() if k not in ("batch", "act_embed")}
    assert sharding.logical_to_spec(("batch", "seq", "act_embed"), rules) == P("data", None, "fsdp")
    assert sharding.logical_to_spec(("decode_rows", "kv_heads", None, None), rules) == \
        P(("data", "fsdp"), "tensor", None, None)
    # off (XLA:CPU's forms): the rules as they are; a table without "decode_rows" (older configs) reads "batch"'s
    assert sharding.decode_rules(False, sharding.DEFAULT_RULES) == dict(sharding.DEFAULT_RULES)
    assert sharding.logical_to_spec(("decode_rows",), sharding.DEFAULT_RULES) == P(("data", "fsdp"))
    # embed unsharded: rows keep every axis, nothing changes for the matmuls
    flat = dict(sharding.DEFAULT_RULES, embed=None)
    assert sharding.decode_rules(rules=flat)["batch"] == ("data", "fsdp")
    with sharding.use_rules(flat):
        assert sharding.decode_rules()["act_embed"] is None


def test_decode_copies_split_the_mlp_and_vocabulary_over_the_embed_axes_too():
    """With the model's dims and a mesh, decode_rules names "decode_mlp" / "decode_vocab" (their own axes, then the
    embed axes) where the dim divides over both; decode_params copies the MLP weights and the unembedding with the
    embed dim whole and that dim split so, and leaves everything else (and params on one device) as it was."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices")
    from sage_jax.models import decoder
    cfg = decoder.ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                              intermediate_size=64, rope_theta=10000.0)
    mesh = sharding.make_mesh((2, 2, 2))
    with jax.set_mesh(mesh):
        rules = decoder.decode_step_rules(cfg, True)
        assert rules["decode_mlp"] == rules["mlp"] == ("tensor", "fsdp")
        assert rules["decode_vocab"] == ("tensor", "fsdp") and rules["vocab"] == "tensor"
        odd = decoder.decode_step_rules(cfg.replace(intermediate_size=66, vocab_size=70), True)
        assert "decode_mlp" not in odd and "decode_vocab" not in odd and odd["mlp"] == "tensor"
        assert "decode_mlp" not in decoder.decode_step_rules(cfg, False)
    assert "decode_mlp" not in decoder.decode_step_rules(cfg, True)  # no mesh: nothing to split
    params = decoder.shard_params(decoder.init_params(cfg, jax.random.key(0)), mesh, cfg=cfg)

    @jax.jit
    def copies(p):
        return decoder.decode_params(cfg, p, decoder.decode_step_rules(cfg, True))
    with jax.set_mesh(mesh):
        out = copies(params)
    spec = lambda x: tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
    assert spec(out["layers"]["w_gate"]) == spec(out["layers"]["w_up"]) == (None, None, ("tensor", "fsdp"))
    assert spec(out["layers"]["w_down"]) == (None, ("tensor", "fsdp"), None)
    assert spec(out["decode_head"]) == (None, ("tensor", "fsdp"))
    # the attention weights where they lie, heads and head dim merged: the same products
    assert out["layers"]["wq"].shape == (2, 32, 32) and out["layers"]["wo"].shape == (2, 32, 32)
    assert spec(out["layers"]["wq"]) == (None, "fsdp", "tensor")
    assert spec(out["layers"]["wo"]) == (None, "tensor", "fsdp")
    assert out["layers"]["wk"].shape == (2, 32, 16) and spec(out["layers"]["wk"]) == (None, "fsdp", "tensor")
    np.testing.assert_array_equal(out["layers"]["wo"], params["layers"]["wo"].reshape(2, 32, 32))
    flat, whole = ({n: p["layers"][n][0] for n in ("wq", "wk", "wo")} for p in (out, params))
    x, heads = jax.random.normal(jax.random.key(1), (3, 1, 32)), jax.random.normal(jax.random.key(2), (3, 1, 4, 8))
    for name, eq, arg in (("wq", "btd,dnh->btnh", x), ("wk", "btd,dkh->btkh", x), ("wo", "btnh,nhd->btd", heads)):
        np.testing.assert_allclose(decoder._project(flat, name, eq, arg, jnp.float32, 8),
                                   decoder._project(whole, name, eq, arg, jnp.float32), rtol=1e-5, atol=1e-6)
    assert decoder.decode_params(cfg, params, sharding.decode_rules(True, sharding.DEFAULT_RULES)) is params


def test_no_decode_copies_where_the_embed_axes_split_nothing():
    from sage_jax.models import decoder
    cfg = decoder.ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                              intermediate_size=64, rope_theta=10000.0)
    with jax.set_mesh(sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])):
        rules = decoder.decode_step_rules(cfg, True)
    assert "decode_mlp" not in rules and "decode_vocab" not in rules and rules["mlp"] == "tensor"
