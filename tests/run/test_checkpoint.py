import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from sage_jax.run import checkpoint as ckpt

# orbax/tensorstore background threads complain after a failed (corrupt) restore; harmless here.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _state(scale: float = 1.0):
    params = {"embed": jnp.arange(32.0).reshape(8, 4) * scale, "layers": {"w": jnp.ones((8, 2)) * scale}}
    return {"params": params, "opt_state": optax.adamw(1e-3).init(params), "step": jnp.asarray(7, jnp.int32)}


def _abstract(state, sharding=None):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding or x.sharding), state)


def _assert_tree_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _save_steps(workdir, steps, keep=5):
    c = ckpt.Checkpointer(workdir, keep=keep)
    for s in steps:
        assert c.save(s, _state(float(s)), {"data_position": s * 10})
    return c


def test_round_trip_with_opt_state_and_meta(tmp_path):
    c = ckpt.Checkpointer(tmp_path)
    state = _state()
    meta = {"data_position": 123, "rng_key": np.array([0, 42], np.uint32), "config": {"lr": 1e-3, "arm": "sage"}}
    c.save(5, state, meta)
    c.close()

    c2 = ckpt.Checkpointer(tmp_path)
    assert c2.latest_step() == 5 and c2.all_steps() == [5]
    step, restored, got_meta = c2.restore(_abstract(state))
    assert step == 5
    _assert_tree_equal(restored, state)
    assert type(restored["opt_state"][0]) is type(state["opt_state"][0])  # namedtuple structure survives
    assert got_meta == {"data_position": 123, "rng_key": [0, 42], "config": {"lr": 1e-3, "arm": "sage"}}


def test_ctrl_c_inside_a_save_is_not_swallowed_and_the_checkpoint_completes(tmp_path, monkeypatch):
    """orbax's wait catches BaseException: a KeyboardInterrupt raised inside it would be dropped and the run go on."""
    import signal
    manager = ckpt.Checkpointer(str(tmp_path), async_save=False)
    real_save = manager._manager.save

    def save_like_orbax(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while orbax waits
        except BaseException:  # noqa: BLE001 - what orbax does with it
            pass
        return real_save(*args, **kwargs)

    monkeypatch.setattr(manager._manager, "save", save_like_orbax)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # ignored under a shell's `&`
    try:
        with pytest.raises(KeyboardInterrupt):
            manager.save(1, {"w": np.ones(3, np.float32)})
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    assert manager.all_steps() == [1]  # the interrupt arrived after the save, not in place of it
    manager.close()


def test_keep_prunes_oldest(tmp_path):
    c = _save_steps(tmp_path, [1, 2, 3, 4], keep=2)
    assert c.all_steps() == [3, 4]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3", "4"]


def test_restore_onto_named_sharding_8_devices(tmp_path):
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    c = ckpt.Checkpointer(tmp_path)
    state = _state()
    c.save(1, state)
    fsdp = NamedSharding(mesh, P("fsdp"))
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=fsdp if x.ndim else
                                                         NamedSharding(mesh, P())), state)
    _, restored, meta = c.restore(target)
    assert meta == {}
    embed = restored["params"]["embed"]
    assert embed.sharding == fsdp and len(embed.addressable_shards) == 8
    assert restored["opt_state"][0].mu["layers"]["w"].sharding == fsdp
    _assert_tree_equal(restored, state)


def test_corrupt_latest_falls_back_with_warning(tmp_path, caplog):
    c = _save_steps(tmp_path, [1, 2, 3])
    (tmp_path / "checkpoints" / "3" / "state" / "_METADATA").unlink()
    with open(tmp_path / "checkpoints" / "3" / "meta" / "metadata", "r+b") as f:
        f.truncate(3)
    with caplog.at_level(logging.WARNING, logger="sage_jax.run.checkpoint"):
        step, restored, meta = c.restore(_abstract(_state()))
    assert step == 2 and meta == {"data_position": 20}
    _assert_tree_equal(restored, _state(2.0))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step 3" in w and "unreadable" in w for w in warnings)
    # the corrupt step is moved aside so step 3 can be saved again by the resumed run
    assert c.all_steps() == [1, 2] and len(os.listdir(tmp_path / "checkpoints_corrupt")) == 1
    assert c.save(3, _state(3.0))


def test_truncated_data_file_is_detected(tmp_path, caplog):
    c = _save_steps(tmp_path, [1, 2])
    data_dir = tmp_path / "checkpoints" / "2" / "state" / "d"
    for f in data_dir.iterdir():
        with open(f, "r+b") as fh:
            fh.truncate(f.stat().st_size // 2)
    with caplog.at_level(logging.WARNING, logger="sage_jax.run.checkpoint"):
        step, _, _ = c.restore(_abstract(_state()))
    assert step == 1


def test_all_corrupt_raises_checkpoint_error(tmp_path):
    c = _save_steps(tmp_path, [1, 2])
    for s in (1, 2):
        (tmp_path / "checkpoints" / str(s) / "state" / "_METADATA").unlink()
    with pytest.raises(ckpt.CheckpointError) as err:
        c.restore(_abstract(_state()))
    msg = str(err.value)
    assert str(tmp_path) in msg and "step 2" in msg and "step 1" in msg and "_METADATA" in msg
    assert isinstance(err.value, RuntimeError)
    assert c.all_steps() == [1, 2]  # nothing moved when nothing could be restored


def test_explicit_step(tmp_path):
    c = _save_steps(tmp_path, [1, 2])
    step, restored, _ = c.restore(jax.eval_shape(lambda: _state()), step=1)  # no shardings: first local device
    assert step == 1
    _assert_tree_equal(restored, _state(1.0))
    with pytest.raises(FileNotFoundError, match="step 9"):
        c.restore(_abstract(_state()), step=9)
    step, raw, meta = c.restore_raw()
    assert step == 2 and meta == {"data_position": 20} and isinstance(raw["params"]["embed"], np.ndarray)
    np.testing.assert_array_equal(raw["opt_state"][0]["mu"]["layers"]["w"], np.zeros((8, 2)))
    np.testing.assert_array_equal(raw["params"]["embed"], np.asarray(_state(2.0)["params"]["embed"]))


def test_empty_workdir_returns_none_and_tmp_dir_ignored(tmp_path):
    c = ckpt.Checkpointer(tmp_path)
    assert c.restore(_abstract(_state())) is None and c.restore_raw() is None and c.latest_step() is None
    c.save(1, _state())
    # a save that crashed mid-way leaves only an orbax tmp dir, which never counts as a step
    (tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp-123").mkdir()
    c2 = ckpt.Checkpointer(tmp_path)
    assert c2.latest_step() == 1 and c2.restore(_abstract(_state()))[0] == 1


def test_async_save_and_bad_meta(tmp_path):
    c = ckpt.Checkpointer(tmp_path, async_save=True)
    c.save(1, _state(), {"k": 1})
    c.wait()
    assert c.latest_step() == 1
    with pytest.raises(ValueError, match="JSON"):
        c.save(2, _state(), {"bad": object()})
    c.close()


def test_export_hf_calls_model_save_hf(tmp_path, monkeypatch):
    from sage_jax.models import decoder as model
    calls = []
    monkeypatch.setattr(model, "save_hf", lambda out, cfg, params: calls.append((out, cfg, params)))
    out = ckpt.export_hf(tmp_path, "cfg", {"p": 1})
    assert out == os.path.join(str(tmp_path), "hf_export") and calls == [(out, "cfg", {"p": 1})]


def test_check_model_names_the_fields_that_differ(tmp_path):
    c = ckpt.Checkpointer(tmp_path)
    c.check_model({"hidden_size": 64})  # nothing saved yet: nothing to compare
    c.save(1, _state(), {"model": {"hidden_size": 64, "num_layers": 2, "param_dtype": "float32"}})
    c.check_model({"hidden_size": 64, "num_layers": 2, "param_dtype": "float32"})
    with pytest.raises(ckpt.CheckpointError) as err:
        c.check_model({"hidden_size": 128, "num_layers": 2, "param_dtype": "bfloat16"})
    msg = str(err.value)
    assert "hidden_size: checkpoint 64, config 128" in msg and "param_dtype" in msg and "num_layers" not in msg
    assert "\n" not in msg and "--workdir" in msg
    c.save(2, _state(), {"rl_step": 2})  # meta from before model meta was stored: not compared
    c.check_model({"hidden_size": 128})
    c.close()


def test_discard_after_moves_the_newer_steps(tmp_path):
    c = _save_steps(tmp_path, [1, 2, 3])
    assert c.discard_after(1) == [2, 3] and c.all_steps() == [1]
    assert len(os.listdir(tmp_path / "checkpoints_corrupt")) == 2
    assert c.save(2, _state(2.0))  # the step number is free again
    assert c.discard_after(None) == [1, 2] and c.all_steps() == []


def test_fallback_reason_keeps_the_cause():
    long = ValueError("OUT_OF_RANGE: Error opening \"zarr\" driver: " + "x" * 400 + ": Requested byte range "
                      "[0, 478) is not valid for value of size 239 [tensorstore_spec[1]='{\"base\": ...}']")
    text = ckpt._cause_text(long)
    assert text.startswith("OUT_OF_RANGE") and text.endswith("is not valid for value of size 239")
    assert "tensorstore_spec" not in text and len(text) < 320


def test_countdown_tokenizer_exports_with_the_same_ids(tmp_path):
    from sage_jax.data import tasks
    tok = tasks._CountdownTok()
    hf = ckpt.hf_tokenizer(tok)
    hf.save_pretrained(tmp_path)
    from transformers import AutoTokenizer
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "3 5 7 => 12: (3+5)*7"
    assert loaded(text).input_ids == tok.encode(text)
    assert loaded.decode(tok.encode(text + "") + [tok.eos_ids[0]], skip_special_tokens=True) == text
    with pytest.raises(ValueError, match="cannot export a tokenizer"):
        ckpt.hf_tokenizer(object())


# --- one run per workdir, resumes with other settings (sage_jax.run.guard, sage_jax.run.record)

def test_a_stale_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path, caplog):
    import json
    import socket
    import subprocess
    import sys
    from sage_jax.run import guard as run_guard
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "run.lock").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "start": "1"}))
    with caplog.at_level(logging.WARNING), run_guard.locked(str(tmp_path)):
        assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
        with run_guard.locked(str(tmp_path)):  # re-entrant within the holder (train -> run_sft -> run_rl)
            pass
        assert (tmp_path / "run.lock").exists()
    assert not (tmp_path / "run.lock").exists()
    assert any("took over the stale lock" in r.getMessage() for r in caplog.records)
    # a live holder (this test's parent process) is never taken over
    (tmp_path / "run.lock").write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname()}))
    with pytest.raises(run_guard.WorkdirBusy, match=f"pid {os.getppid()} on host"):
        run_guard.acquire(str(tmp_path))


def _tiny_config(*overrides):
    from sage_jax.run import config as config_lib
    return config_lib.load("configs/tiny_test.py", list(overrides))


def test_resume_with_other_settings_is_refused_unless_allowed_and_then_recorded(tmp_path, monkeypatch):
    import json
    from sage_jax.run import config as config_lib, record as run_record
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    c = ckpt.Checkpointer(tmp_path / "rl")
    c.save(2, {"w": jnp.zeros(2)}, {"rl_step": 2, "config": run_record.as_record(_tiny_config())})
    # steps, cadences and evaluation settings may change
    run_record.check_resume(_tiny_config("--config.train.steps=9", "--config.train.ckpt_every=4", "--config.eval.n=8",
                                         "--config.eval.ks=1,8"), c, str(tmp_path))
    changed = _tiny_config("--config.seed=7", "--config.loss.kl_estimator=k2", "--config.train.steps=3")
    with pytest.raises(config_lib.ConfigError) as e:
        run_record.check_resume(changed, c, str(tmp_path))
    assert "loss.kl_estimator: checkpoint 'k3', now 'k2'" in str(e.value)
    assert "seed: checkpoint 0, now 7" in str(e.value)
    assert "train.steps" not in str(e.value) and "allow_config_change=True" in str(e.value)
    assert not (tmp_path / run_record.CHANGES_FILE).exists()
    with changed.unlocked():
        changed.train.allow_config_change = True
    run_record.check_resume(changed, c, str(tmp_path))
    (entry,) = json.loads((tmp_path / run_record.CHANGES_FILE).read_text())
    assert entry["step"] == 2 and entry["config"]["seed"] == 7
    assert set(entry["changed"]) == {"seed", "loss.kl_estimator"}  # allow_config_change itself may change
    assert entry["changed"]["seed"] == {"checkpoint": 0, "now": 7}
    c.close()


def test_step_stop_finishes_the_step_saves_it_and_a_second_signal_aborts(tmp_path):
    import signal
    from sage_jax.run import guard as run_guard
    c = ckpt.Checkpointer(tmp_path)
    saved, closed = [], []

    class Closer:
        def close(self):
            closed.append(True)
    stop = run_guard.StepStop("RL step", c, lambda done: (saved.append(done), c.save(done, {"w": jnp.zeros(2)})),
                              closers=(Closer(),))
    previous = signal.getsignal(signal.SIGTERM)
    ran = []
    with pytest.raises(run_guard.Stopped) as e:
        for step in stop.steps(3, 100):
            ran.append(step)
            if step == 4:
                os.kill(os.getpid(), signal.SIGTERM)  # mid-step: the step still finishes
    assert ran == [3, 4] and saved == [5] and c.all_steps() == [5] and closed == [True]
    assert e.value.code == 143 and "stopped by SIGTERM after RL step 5: checkpoint saved at" in e.value.message
    assert signal.getsignal(signal.SIGTERM) is previous  # the loop's handler is gone
    # a second signal goes to the handler from before the loop (here: raise Terminated at once)
    signal.signal(signal.SIGTERM, run_guard._raise_terminated)
    try:
        with pytest.raises(run_guard.Terminated):
            for step in run_guard.StepStop("RL step", c, lambda done: None).steps(0, 10):
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
    c.close()
