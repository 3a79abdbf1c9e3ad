"""Resuming a real run with harmless changes (a moved model, decode slots, evaluation sets) and with harmful ones (a
model with other weights at the path, another LoRA rank): trainer.run_rl with the resume checks of run/record.py
and the model check of run/checkpoint.py."""

import json
import shutil

import pytest

from sage_jax.run import checkpoint
from sage_jax.run import config as config_lib
from sage_jax.training import trainer


def _tiny(**overrides):
    base = {"train.steps": 1, "train.ckpt_every": 1, "train.sample_every": 0, "train.use_tensorboard": False}
    return config_lib.load("configs/tiny_test.py", [f"--config.{k}={v}" for k, v in {**base, **overrides}.items()])


def _metrics(workdir) -> dict:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {(r["step"], k): v for r in rows for k, v in r.items() if not k.startswith(("time", "perf")) and k != "step"}


def test_a_model_moved_with_the_same_weights_resumes_and_other_weights_are_refused(tmp_path):
    from tests.helpers_hf import tiny_hf_model
    first = tiny_hf_model(tmp_path / "models" / "first", seed=0)
    workdir = tmp_path / "wd"
    trainer.run_rl(_tiny(**{"model.path": str(first)}), str(workdir))
    moved = tmp_path / "elsewhere" / "model"
    shutil.copytree(first, moved)
    shutil.rmtree(first)
    trainer.run_rl(_tiny(**{"model.path": str(moved), "train.steps": 2}), str(workdir))
    assert sorted(int(p.name) for p in (workdir / "rl" / "checkpoints").iterdir()) == [1, 2]
    other = tiny_hf_model(tmp_path / "models" / "other", seed=1)  # the same shapes, other weights
    with pytest.raises(checkpoint.CheckpointError, match="weights_fingerprint"):
        trainer.run_rl(_tiny(**{"model.path": str(other), "train.steps": 3}), str(workdir))


def test_decode_slots_and_evaluation_sets_change_on_resume_without_changing_the_run(tmp_path):
    trainer.run_rl(_tiny(**{"train.steps": 3}), str(tmp_path / "straight"))
    trainer.run_rl(_tiny(**{"train.steps": 2}), str(tmp_path / "resumed"))
    trainer.run_rl(_tiny(**{"train.steps": 3, "rollout.slots": 4, "data.eval_problems": 3, "data.num_eval": 8}),
                   str(tmp_path / "resumed"))
    assert _metrics(tmp_path / "resumed") == _metrics(tmp_path / "straight")


def test_a_lora_rank_change_names_the_rank_even_when_changes_are_allowed(tmp_path):
    lora = {"model.lora.rank": 2, "model.lora.alpha": 4.0}
    trainer.run_rl(_tiny(**lora), str(tmp_path))
    with pytest.raises(config_lib.ConfigError, match="LoRA rank differs") as e:
        trainer.run_rl(_tiny(**{**lora, "model.lora.rank": 4, "train.steps": 2, "train.allow_config_change": True}),
                       str(tmp_path))
    assert "model.lora.rank: checkpoint 2, now 4" in str(e.value) and "unreadable" not in str(e.value)
    assert sorted(int(p.name) for p in (tmp_path / "rl" / "checkpoints").iterdir()) == [1]  # nothing moved away


def test_a_changed_seed_and_kl_estimator_are_named_not_only_the_weights_fingerprint(tmp_path):
    """Issue 50, item 16: with random-init weights the fingerprint follows the seed; the fields changed are named."""
    trainer.run_rl(_tiny(), str(tmp_path))
    with pytest.raises(config_lib.ConfigError) as e:
        trainer.run_rl(_tiny(**{"seed": 1, "loss.kl_estimator": "k1", "train.steps": 2}), str(tmp_path))
    message = str(e.value)
    assert "seed: checkpoint 0, now 1" in message and "loss.kl_estimator: checkpoint" in message, message
    assert not (tmp_path / "config_changes.json").exists()
    # allowed, the settings are recorded only once the model check passed: here it does not (other weights)
    with pytest.raises(checkpoint.CheckpointError, match="weights_fingerprint"):
        trainer.run_rl(_tiny(**{"seed": 1, "train.steps": 2, "train.allow_config_change": True}), str(tmp_path))
    assert not (tmp_path / "config_changes.json").exists()
