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
