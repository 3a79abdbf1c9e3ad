"""One run of a study (sage_jax.experiments.runs): settings files, fingerprints, result files, claims and times."""

import json
import os
import time
import types

import pytest

from sage_jax.experiments import runs, study
from sage_jax.run import guard

SMOL = runs.settings("configs/smollm2_arms.py")
COUNTDOWN = runs.settings("configs/countdown_arms.py")


def test_a_missing_settings_file_is_one_line():
    with pytest.raises(FileNotFoundError, match="no settings file configs/nope.py"):
        runs.settings("configs/nope.py")
    assert runs.settings("configs/smollm2_arms.py") is SMOL  # loaded once


def test_fingerprint_tracks_what_changes_a_run():
    fp = lambda arm, *o, seed=0: runs.fingerprint(SMOL, runs.load_config(SMOL, arm, "study", list(o), seed))
    assert fp("grpo") == fp("grpo", "--config.model.path=/elsewhere", "--config.train.ckpt_every=8")
    assert fp("grpo") != fp("grpo", "--config.optim.lr=1.5e-5") != fp("grpo", seed=1)
    # the base is evaluated only: RL settings leave it alone (the regime's candidates share one base), eval does not
    assert fp("base") == fp("base", "--config.optim.lr=5e-4", "--config.train.steps=16")
    assert fp("base") == fp("base", "--config.model.path=/elsewhere")  # the weights' own fingerprint is recorded
    assert fp("base") != fp("base", "--config.eval.n=16") and fp("base") != fp("grpo")
    # partial rollouts' settings (added after the first results) count only when partial rollouts are on
    assert fp("grpo") == fp("grpo", "--config.rollout.oversample=2", "--config.rollout.max_lag=1")
    assert fp("grpo", "--config.rollout.partial=True") != fp("grpo")
    assert (fp("grpo", "--config.rollout.partial=True", "--config.rollout.oversample=2")
            != fp("grpo", "--config.rollout.partial=True"))


def test_countdown_fingerprint_counts_the_sft_base():
    fp = lambda arm, *o: runs.fingerprint(COUNTDOWN, runs.load_config(COUNTDOWN, arm, "tiny", list(o)))
    assert fp("grpo") != fp("grpo", "--config.sft.steps=5")  # every run starts from the SFT model
    assert fp("base") != fp("base", "--config.sft.steps=5") and fp("base") == fp("base", "--config.optim.lr=0.5")
    assert fp("grpo") == fp("grpo", "--config.experiment.sweep_seeds=3")  # bookkeeping
    assert fp("grpo_branch") != fp("grpo")


def test_differences_are_from_the_settings_reference():
    config = runs.load_config(SMOL, "nokl", "study", seed=2)
    diff = runs.differences(SMOL, config)
    assert diff["loss.beta"] == 0.0 and diff["seed"] == 2 and "model.path" not in diff
    assert runs.differences(COUNTDOWN, runs.load_config(COUNTDOWN, "grpo_nokl", "tiny"))["loss.beta"] == 0.0


def test_a_truncated_result_file_is_one_line_naming_it(tmp_path):
    """Issue 50, item 6: a result file cut short stopped the study with `error: Unterminated string ...`."""
    path = tmp_path / "runs" / "grpo" / "seed0.json"
    runs.write_result(str(path), {"schema": runs.SCHEMA, "arm": "grpo", "seed": 0, "command": "a long string"})
    path.write_text(path.read_text()[:40])
    with pytest.raises(ValueError, match=f"^{path} is cut short or not JSON .*delete it to redo that run") as e:
        runs.read_result(str(path))
    assert "Unterminated" not in str(e.value)
    with pytest.raises(ValueError, match=str(path)):  # the whole command, before it renders anything
        study.main(["--settings", "configs/smollm2_arms.py", "--out", str(tmp_path), "--report-only",
                    "--arms", "grpo"])


def test_result_files_of_both_harnesses_read_alike(tmp_path):
    runs.write_result(str(tmp_path / "a.json"), {"schema": "smollm2_study/1", "eval": {"n": [4], "correct": [1]}})
    runs.write_result(str(tmp_path / "b.json"), {"schema": runs.SCHEMA, "eval": {"x": {"n": [4], "correct": [1]}}})
    runs.write_result(str(tmp_path / "c.json"), {"schema": "other"})
    assert runs.read_result(str(tmp_path / "a.json"))["eval"] == {"heldout": {"n": [4], "correct": [1]}}
    assert runs.read_result(str(tmp_path / "b.json"))["eval"] == {"x": {"n": [4], "correct": [1]}}
    assert runs.read_result(str(tmp_path / "c.json")) is None and runs.read_result(str(tmp_path / "d.json")) is None
    assert (tmp_path / "a.json").read_text().count("\n") == 4  # one top-level key per line


def test_claim_lets_one_process_run_a_directory(tmp_path):
    run_dir = str(tmp_path / "run")
    with runs.claim(run_dir) as first:
        assert first
        with runs.claim(run_dir) as second:  # the claim file names this (live) process
            assert not second
    with runs.claim(run_dir) as again:  # released
        assert again
    (tmp_path / "run" / "claim.pid").write_text("999999999")  # a process that is gone: a stale claim is taken over
    with runs.claim(run_dir) as stale:
        assert stale


def test_a_run_stopped_by_sigint_keeps_the_time_its_steps_took(tmp_path, monkeypatch):
    """Issue 50, item 12: after a clean SIGINT (guard.Stopped at a step boundary) the resumed run recorded only its
    own attempt (2.5 s where the steps took 89 s)."""
    from sage_jax.experiments import measure
    from sage_jax.training import trainer
    config = runs.load_config(SMOL, "grpo", "study")
    job = runs.Job("grpo", 0, config, str(tmp_path / "out" / "seed0.json"), str(tmp_path / "work"), "grpo/seed0",
                   runs.fingerprint(SMOL, config))

    def stopped(*a, **k):
        time.sleep(0.5)  # the steps before the signal
        raise guard.Stopped(130, "interrupted at step 4")
    monkeypatch.setattr(trainer, "run_rl", stopped)
    with pytest.raises(guard.Stopped):
        runs.run_job(SMOL, job, None, (None, None, "w0"), "cmd")
    assert json.loads((tmp_path / "work" / "times.json").read_text())["train_wall_s"] >= 0.5
    monkeypatch.setattr(trainer, "run_rl", lambda *a, **k: types.SimpleNamespace(cfg=None, policy=None))
    monkeypatch.setattr(measure, "evaluate", lambda *a: {"heldout": {"n": [4], "correct": [2]}})
    record = runs.run_job(SMOL, job, None, (None, None, "w0"), "cmd")  # the resumed attempt: no step left
    assert record["times"]["train_wall_s"] >= 0.5 and record["times"]["attempts"] == 2
    assert record["times"]["this_attempt_wall_s"] < 0.5
    assert runs.read_result(job.path)["times"]["train_wall_s"] == record["times"]["train_wall_s"]
    assert os.path.exists(job.path) and record["weights"] == "w0" and record["settings"]["loss.guide"] == "none"
