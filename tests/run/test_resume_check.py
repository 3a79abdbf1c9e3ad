"""run/record.py's resume check: what may change (settings that cannot change a result), a field added to the code
since the checkpoint (compared as its default), a moved model (allowed where the checkpoint recorded its weights'
fingerprint), and a LoRA rank change (named as such, even with allow_config_change)."""

import os

import jax.numpy as jnp
import pytest

from sage_jax.run import checkpoint as ckpt
from sage_jax.run import config as config_lib
from sage_jax.run import record as run_record

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(*overrides):
    return config_lib.load(os.path.join(ROOT, "configs", "tiny_test.py"), list(overrides))


def _checkpoint(tmp_path, config, model=None):
    c = ckpt.Checkpointer(tmp_path / "rl")
    meta = {"rl_step": 2, "config": run_record.as_record(config)}
    c.save(2, {"w": jnp.zeros(2)}, {**meta, **({"model": model} if model is not None else {})})
    return c


@pytest.mark.parametrize("flag", ["--config.rollout.slots=8", "--config.data.eval=countdown",
                                  "--config.data.eval_problems=5", "--config.data.num_eval=32"])
def test_settings_that_cannot_change_a_result_may_change(tmp_path, flag):
    c = _checkpoint(tmp_path, _config())
    run_record.check_resume(_config(flag), c, str(tmp_path))
    assert not (tmp_path / run_record.CHANGES_FILE).exists()
    c.close()


def test_a_field_added_since_the_checkpoint_is_compared_as_its_default(tmp_path):
    saved = run_record.as_record(_config())
    del saved["train"]["off_policy_steps"]  # a checkpoint of a version without the field
    del saved["rollout"]["slots"]
    assert run_record.differences(saved, run_record.as_record(_config())) == {}
    changed = run_record.differences(saved, run_record.as_record(_config("--config.train.off_policy_steps=1")))
    assert changed == {"train.off_policy_steps": {"checkpoint": 0, "now": 1}}
    # a field the code has no default for still counts as absent
    assert run_record.differences({}, {"experiment": {"x": 1}}) == {"experiment.x": {"checkpoint": "<absent>",
                                                                                     "now": 1}}


def test_a_moved_model_may_change_where_the_checkpoint_recorded_its_weights(tmp_path):
    before, moved = _config("--config.model.path=/old/place"), _config("--config.model.path=/new/place")
    recorded = _checkpoint(tmp_path / "a", before, {"hidden_size": 64, "weights_fingerprint": "0123abcd"})
    run_record.check_resume(moved, recorded, str(tmp_path / "a"))  # Checkpointer.check_model compares the weights
    with pytest.raises(config_lib.ConfigError, match="model.path: checkpoint '/old/place', now '/new/place'"):
        run_record.check_resume(moved, recorded, str(tmp_path / "a"), sft=True)  # SFT records no fingerprint
    unrecorded = _checkpoint(tmp_path / "b", before, {"hidden_size": 64})
    with pytest.raises(config_lib.ConfigError, match="model.path"):
        run_record.check_resume(moved, unrecorded, str(tmp_path / "b"))
    recorded.close(), unrecorded.close()


@pytest.mark.parametrize("allow", [False, True])
def test_a_lora_rank_change_is_named_not_called_unreadable(tmp_path, allow):
    c = _checkpoint(tmp_path, _config("--config.model.lora.rank=4"))
    now = _config("--config.model.lora.rank=8", f"--config.train.allow_config_change={allow}")
    with pytest.raises(config_lib.ConfigError) as e:
        run_record.check_resume(now, c, str(tmp_path))
    message = str(e.value)
    assert "LoRA rank differs" in message and "model.lora.rank: checkpoint 4, now 8" in message, message
    assert "--config.model.lora.rank=4" in message and "unreadable" not in message and "move" not in message
    assert "add --config.train.allow_config_change" not in message
    assert not (tmp_path / run_record.CHANGES_FILE).exists()
    # without adapters (rank 0 on both sides) the targets change no shapes: an ordinary, allowed change
    c0 = _checkpoint(tmp_path / "full", _config())
    run_record.check_resume(_config("--config.model.lora.targets=q_proj", "--config.train.allow_config_change=True"),
                            c0, str(tmp_path / "full"))
    c.close(), c0.close()


def test_the_weights_fingerprint_is_the_same_on_any_mesh_and_sees_one_changed_element():
    """What check_model compares for a moved model: a resume may change mesh.* (MAY_CHANGE), so the fingerprint
    must not depend on the layout; any bit of any element must change it."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from sage_jax.models import sharding
    w = np.random.default_rng(0).standard_normal((16, 24)).astype(np.float32)
    tree = {"w": w, "b": np.arange(8, dtype=np.float32).astype(jnp.bfloat16)}
    one = sharding.fingerprint(jax.device_put(tree, jax.devices()[0]))
    mesh = sharding.make_mesh((1, -1, 2))  # 8 CPU devices: fsdp 4 x tensor 2
    spread = jax.device_put(tree, {"w": NamedSharding(mesh, P("fsdp", "tensor")), "b": NamedSharding(mesh, P("fsdp"))})
    assert sharding.fingerprint(spread) == one
    nudged = w.copy()
    nudged[3, 5] = np.nextafter(nudged[3, 5], np.float32(np.inf))  # one ulp
    swapped = w.copy()
    swapped[0, [0, 1]] = swapped[0, [1, 0]]
    for other in (nudged, swapped, w.T.copy().reshape(16, 24)):
        assert sharding.fingerprint({**tree, "w": other}) != one
