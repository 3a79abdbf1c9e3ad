"""The checks a run makes before it writes or loads anything (training/preflight.py)."""

import json

import jax.numpy as jnp
import pytest

from sage_jax.models import build, sharding
from sage_jax.run import checkpoint, config as config_lib, record as run_record
from sage_jax.training import preflight


def _config(**overrides):
    return config_lib.load("configs/tiny_test.py", [f"--config.{k}={v}" for k, v in overrides.items()])


def _meta(cfg):
    return checkpoint.model_meta(cfg)


def test_the_model_read_without_weights_is_the_one_loaded(tmp_path):
    """What the checkpoints are compared with before the model loads is what the loaded model records."""
    from tests.helpers_hf import tiny_hf_model
    from sage_jax.data import tasks
    mesh = sharding.make_mesh((1, -1, 1))
    model_dir = tiny_hf_model(tmp_path / "m", arch="qwen3", tied=True, head_dim=16)
    for config in (_config(), _config(**{"model.path": str(model_dir), "model.param_dtype": "bfloat16"})):
        tokenizer = tasks.build(config).tokenizer
        loaded, _ = build.load_or_init_params(config, mesh, dict(config.mesh.rules), tokenizer)
        assert _meta(build.config_without_weights(config, tokenizer)) == _meta(loaded)


def test_a_run_allowed_to_change_settings_records_the_change_once(tmp_path):
    """With allow_config_change the check is left to the run, which records the change (config_changes.json)."""
    ck = checkpoint.Checkpointer(tmp_path / "rl")
    ck.save(1, {"w": jnp.zeros(2)}, {"rl_step": 1, "config": run_record.as_record(_config())})
    ck.close()
    with pytest.raises(config_lib.ConfigError, match="seed: checkpoint 0, now 3"):
        preflight.check(_config(seed=3), str(tmp_path))
    prepared = preflight.check(_config(**{"seed": 3, "train.allow_config_change": True}), str(tmp_path))
    assert prepared.task.train and prepared.sft_data is None
    assert not (tmp_path / run_record.CHANGES_FILE).exists()


def test_a_finished_sft_is_not_checked_and_nothing_is_written(tmp_path):
    ck = checkpoint.Checkpointer(tmp_path / "sft")
    ck.save(2, {"w": jnp.zeros(2)}, {"sft_step": 2, "model": {"hidden_size": 32}})
    ck.close()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(checkpoint.CheckpointError, match="hidden_size: checkpoint 32, config 64"):
        preflight.check(_config(**{"sft.steps": 4, "sft.num_demos": 8}), str(tmp_path))
    prepared = preflight.check(_config(**{"sft.steps": 2, "sft.num_demos": 8}), str(tmp_path), rl=False)
    assert prepared.sft_data.tokens.shape[0] == 8
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # no rl/ made, no file written
    (tmp_path / "summary.json").write_text(json.dumps([1]))
    with pytest.raises(ValueError, match="summary.json holds a list"):
        preflight.check(_config(), str(tmp_path))
