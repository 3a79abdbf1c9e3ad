"""train.off_policy_steps: the pipeline's bookkeeping (which policy sampled which batch), k = 0 unchanged, resume
equality at k = 1 and k = 2, the split placement (mesh.rollout_devices) against the colocated one, which thread runs
which phase, and a stop that saves the state before it waits for the batches in flight."""

import json
import os
import signal
import threading
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax.run import config as config_lib
from sage_jax.models import sharding
from sage_jax.run import guard as run_guard
from sage_jax.training import offpolicy, rollouts, trainer


def _tiny(**overrides):
    base = {"train.steps": 3, "train.ckpt_every": 1, "train.sample_every": 0, "train.use_tensorboard": False}
    return config_lib.load("configs/tiny_test.py", [f"--config.{k}={v}" for k, v in {**base, **overrides}.items()])


def _metrics(workdir) -> dict:
    """{(step, key): value} of metrics.jsonl without the timings (and what is derived from them: perf/)."""
    out = {}
    for line in open(workdir / "metrics.jsonl"):
        row = json.loads(line)
        out.update({(row["step"], k): v for k, v in row.items()
                    if not k.startswith(("time", "perf/tokens_per_s", "perf/gen_")) and k != "step"})
    return out


def _fingerprint(params) -> float:
    return float(np.asarray(jax.tree.leaves(params)[0], np.float64).sum())


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_pipeline_hands_step_t_the_batch_of_step_t_minus_k_and_samples_from_its_own_copy(compute_dtype):
    """(bfloat16: the sampler's own copy is the cast one, model.compute_params, and no second copy is made.)"""
    from sage_jax.models import decoder as model
    release = threading.Event()
    seen = []

    def collect(params, step):
        if step > 0:
            release.wait(10)  # the trainer has donated the params by now
        assert params.dtype == jnp.dtype(compute_dtype)
        seen.append((step, float(params[0])))
        return {"version": float(params[0])}, {}
    mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
    cfg = model.preset("tiny", compute_dtype=compute_dtype)
    place = offpolicy.placement(SimpleNamespace(base=None, cfg=cfg), None, {}, off_policy=True)
    donate = jax.jit(lambda x: x + 1.0, donate_argnums=0)
    got = []
    with offpolicy.Pipeline(collect, 1, 4, mesh=mesh, rules={}, place=place) as pipe:
        params = jnp.zeros(3)
        for step in range(4):
            ro, stats = pipe(params, step)
            release.clear()
            params = donate(params)  # the update: the sampler's copy must survive it
            release.set()
            got.append((ro["version"], stats["rl/staleness"]))
    assert got == [(0.0, 0.0), (0.0, 1.0), (1.0, 1.0), (2.0, 1.0)]
    assert [s for s, _ in seen] == [0, 1, 2, 3]  # no batch sampled twice, none past the last step


def test_pipeline_refuses_a_batch_older_than_k():
    mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
    pipe = offpolicy.Pipeline(lambda p, s: ({}, {"time/collect_s": 0.0}), 1, 5, mesh=mesh, rules={},
                              place=lambda p: (p, {}))
    pipe._load = lambda step: ({}, {"time/collect_s": 0.0}, step - 2)  # e.g. a stale saved batch
    with pytest.raises(RuntimeError, match="off_policy_steps=1"):
        pipe(None, 3)
    pipe.close()


def test_off_policy_zero_is_the_serial_loop(tmp_path, monkeypatch):
    """k = 0: metrics.jsonl (every key but the timings) as the loop that calls collect in place, and no new keys."""
    trainer.run_rl(_tiny(**{"train.steps": 2}), str(tmp_path / "pipeline"))

    class InPlace:  # the loop before the pipeline: rl_step(ctx, state, step, partial(collect_rollouts, ...))
        def __init__(self, collect, *args, **kwargs):
            self.collect = lambda params, step: trainer.collect_rollouts(*collect.args[:3], collect.args[3].pool,
                                                                         params, step)
        __call__ = lambda self, params, step: self.collect(params, step)
        drain = save = close = lambda self, *a, **k: None
        __enter__ = lambda self: self
        __exit__ = lambda self, *exc: None
    monkeypatch.setattr(trainer.offpolicy, "Pipeline", InPlace)
    trainer.run_rl(_tiny(**{"train.steps": 2}), str(tmp_path / "serial"))
    assert _metrics(tmp_path / "pipeline") == _metrics(tmp_path / "serial")


@pytest.fixture(scope="module")
def k1_run(tmp_path_factory):
    """A 4-step k = 1 run, recording the fingerprint of the params each batch was sampled with and of the params
    each step starts from."""
    workdir = tmp_path_factory.mktemp("k1")
    sampled, started = {}, {}
    real_collect, real_step = trainer.collect_phases, trainer.rl_step

    def collect(task, cfg, config, pool, params, step):
        sampled[step] = _fingerprint(params)
        return real_collect(task, cfg, config, pool, params, step)

    def rl_step(ctx, state, step, collect_fn):
        started[step] = _fingerprint(ctx.policy(state["params"]))
        return real_step(ctx, state, step, collect_fn)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer, "collect_phases", collect)
        mp.setattr(trainer, "rl_step", rl_step)
        result = trainer.run_rl(_tiny(**{"train.steps": 4, "train.off_policy_steps": 1}), str(workdir))
    return SimpleNamespace(workdir=workdir, sampled=sampled, started=started, params=result.state["params"])


def test_k1_trains_each_step_on_the_batch_of_the_previous_steps_params(k1_run):
    sampled, started = k1_run.sampled, k1_run.started
    assert sorted(sampled) == [0, 1, 2, 3]
    assert sampled[0] == started[0]
    for t in (1, 2, 3):
        assert sampled[t] == started[t - 1] != started[t], t
    m = _metrics(k1_run.workdir)
    assert [m[(t, "rl/staleness")] for t in range(4)] == [0.0, 1.0, 1.0, 1.0]
    assert all(np.isfinite(m[(t, "rl/ratio_mean")]) for t in range(4))
    # the colocated copy the sampler reads is waited for and timed on its own (not inside time/batch_s)
    rows = [json.loads(line) for line in open(k1_run.workdir / "metrics.jsonl")]
    syncs = {row["step"]: row["time/weight_sync"] for row in rows if "time/weight_sync" in row}
    assert sorted(syncs) == [0, 1, 2] and all(s > 0 for s in syncs.values())  # the copies for batches 1, 2, 3


def test_k1_killed_and_resumed_equals_the_uninterrupted_run(k1_run, tmp_path, monkeypatch):
    config = _tiny(**{"train.steps": 4, "train.off_policy_steps": 1})
    real_step = trainer.rl_step

    def dies_at_step_2(ctx, state, step, collect):
        if step == 2:
            raise KeyboardInterrupt  # after the checkpoint at 2, with batch 2 in flight
        return real_step(ctx, state, step, collect)
    monkeypatch.setattr(trainer, "rl_step", dies_at_step_2)
    with pytest.raises(KeyboardInterrupt):
        trainer.run_rl(config, str(tmp_path))
    assert (tmp_path / "offpolicy" / "batch_2.npz").exists()
    monkeypatch.setattr(trainer, "rl_step", real_step)
    resumed = trainer.run_rl(config, str(tmp_path))
    assert _metrics(tmp_path) == _metrics(k1_run.workdir)
    for a, b in zip(jax.tree.leaves(resumed.state["params"]), jax.tree.leaves(k1_run.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_split_placement_matches_colocated(k1_run, tmp_path):
    """Sampler on 4 devices, training on the other 4, weights copied after each update: the colocated run's
    metrics (8 devices) within float tolerance."""
    assert jax.device_count() == 8
    trainer.run_rl(_tiny(**{"train.steps": 4, "train.off_policy_steps": 1, "mesh.rollout_devices": 4}),
                   str(tmp_path))
    split, colocated = _metrics(tmp_path), _metrics(k1_run.workdir)
    assert split.keys() == colocated.keys()
    for key, value in colocated.items():
        if key[1] == "perf/padded_frac":  # the packed layout follows the training devices' count (4 vs 8)
            continue
        np.testing.assert_allclose(split[key], value, rtol=1e-4, atol=1e-5, err_msg=str(key))
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    syncs = [row["time/weight_sync"] for row in lines if "time/weight_sync" in row]
    assert len(syncs) == 3 and min(syncs) > 0  # steps 0-2 place the weights for batches 0-3; the last step none


def test_make_meshes_splits_the_devices():
    devices = jax.devices()[:8]
    train, rollout = sharding.make_meshes((1, -1, 2), 4, devices)
    assert list(train.devices.flat) == devices[:4] and dict(train.shape) == {"data": 1, "fsdp": 2, "tensor": 2}
    assert list(rollout.devices.flat) == devices[4:] and dict(rollout.shape) == {"data": 2, "fsdp": 1, "tensor": 2}
    assert sharding.make_meshes((1, -1, 1), 0, devices)[1] is None
    for bad in (8, 9):
        with pytest.raises(ValueError, match="rollout_devices"):
            sharding.make_meshes((1, -1, 1), bad, devices)


def test_qwen7b_async_preset_takes_the_predicted_placement_and_the_default_stays_on_policy():
    from sage_jax.run import config as config_lib
    on_policy = config_lib.load("configs/qwen7b_branch.py", [])
    assert on_policy.train.off_policy_steps == 0 and on_policy.mesh.rollout_devices == 0  # the paper's algorithm
    fast = config_lib.load("configs/qwen7b_branch.py:async", [])
    assert fast.train.off_policy_steps == 1 and fast.mesh.rollout_devices == 8
    # the sampler's 8 chips as (data 2, tensor 4) leave stage widths the model prices (at least 2 slots per shard)
    from sage_jax.sampling import decode_pool
    assert decode_pool.stage_widths(fast.rollout.prompts_per_step * fast.rollout.group_size, 2)[-1] >= 4


# --------------------------------------------------------------------------------------------- threads and phases

def _phased(where):
    """A phased collect recording (step, kind of stretch, thread) for every stretch it runs."""
    def collect(params, step):
        where.append((step, rollouts.DEVICE, threading.get_ident()))  # the first stretch: sampling
        yield rollouts.HOST
        where.append((step, rollouts.HOST, threading.get_ident()))  # reading and decoding
        yield rollouts.HOST
        where.append((step, rollouts.HOST, threading.get_ident()))  # scoring
        yield rollouts.DEVICE
        where.append((step, rollouts.DEVICE, threading.get_ident()))  # the rewards' gather
        return {"version": params}, {}
    return collect


@pytest.mark.parametrize("serial", [True, False])
def test_serial_dispatch_issues_every_device_stretch_from_the_calling_thread(serial):
    """serial (the default on several processes): the rollout thread runs only host stretches, so every process
    issues its multi-process operations from its main thread; otherwise the rollout thread runs them all."""
    mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
    where, main = [], threading.get_ident()
    with offpolicy.Pipeline(_phased(where), 1, 4, mesh=mesh, rules={}, place=lambda p: (p, {}),
                            serial=serial) as pipe:
        got = [pipe(float(step), step) for step in range(4)]
    assert [(ro["version"], stats["rl/staleness"]) for ro, stats in got] == [(0.0, 0.0), (0.0, 1.0), (1.0, 1.0),
                                                                            (2.0, 1.0)]
    assert len(where) == 16 and all(t == main for step, _, t in where if step == 0)  # sampled on the spot
    for step, kind, thread in where:
        if step > 0:  # started in the background
            assert (thread == main) == (serial and kind == rollouts.DEVICE), (step, kind)


def test_leaving_the_pipeline_on_an_exception_does_not_wait_for_the_batch_in_flight():
    mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
    release = threading.Event()

    def collect(params, step):
        if step > 0:
            release.wait(30)  # a slow generation
        return {}, {}
    try:
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match="boom"):
            with offpolicy.Pipeline(collect, 1, 4, mesh=mesh, rules={}, place=lambda p: (p, {})) as pipe:
                pipe(0.0, 0)  # starts batch 1 in the background
                raise RuntimeError("boom")
        assert time.perf_counter() - t0 < 5 and not release.is_set()
    finally:
        release.set()


def _slowed(slow_step: int, wait):
    """trainer.collect_phases whose batch `slow_step` first runs wait() on the rollout thread (a slow generation)."""
    real = trainer.collect_phases

    def collect(task, cfg, config, pool, params, step):
        if step == slow_step:
            yield rollouts.HOST
            wait()
        return (yield from real(task, cfg, config, pool, params, step))
    return collect


def _signal_at(step_to_signal: int):
    real_step = trainer.rl_step

    def rl_step(ctx, state, step, collect):
        if step == step_to_signal:
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice, mid-step
        return real_step(ctx, state, step, collect)
    return rl_step


def test_sigterm_writes_the_state_before_it_waits_for_the_batch_in_flight(k1_run, tmp_path, monkeypatch):
    """Stopped after step 2 with batch 2 still generating: checkpoint 2's state is on disk while the batch is not
    done yet (the batch waits for it here, up to 20 s); the batch is saved after it, and the resume is exact."""
    config = _tiny(**{"train.steps": 4, "train.off_policy_steps": 1, "train.ckpt_every": 100})
    state_dir = tmp_path / "rl" / "checkpoints" / "2"
    seen = []

    def generation_waits_for_the_state():
        deadline = time.time() + 20
        while not state_dir.is_dir() and time.time() < deadline:
            time.sleep(0.05)
        seen.append(state_dir.is_dir())
    monkeypatch.setattr(trainer, "collect_phases", _slowed(2, generation_waits_for_the_state))
    monkeypatch.setattr(trainer, "rl_step", _signal_at(1))
    with pytest.raises(run_guard.Stopped) as e:
        trainer.run_rl(config, str(tmp_path))
    assert e.value.code == 143 and "after RL step 2" in e.value.message
    assert seen == [True]  # the state was written while the generation was still in flight
    assert (tmp_path / "offpolicy" / "batch_2.npz").exists()  # and the batch after it
    monkeypatch.undo()
    trainer.run_rl(config, str(tmp_path))
    assert _metrics(tmp_path) == _metrics(k1_run.workdir)


def test_a_second_sigterm_aborts_without_waiting_for_the_batch_in_flight(tmp_path, monkeypatch):
    config = _tiny(**{"train.steps": 4, "train.off_policy_steps": 1, "train.ckpt_every": 100})
    state_dir = tmp_path / "rl" / "checkpoints" / "2"
    release, sent = threading.Event(), []

    def generation_hangs():
        deadline = time.time() + 20
        while not state_dir.is_dir() and time.time() < deadline:
            time.sleep(0.05)
        sent.append(time.perf_counter())
        os.kill(os.getpid(), signal.SIGTERM)  # "abort now"
        release.wait(30)
    monkeypatch.setattr(trainer, "collect_phases", _slowed(2, generation_hangs))
    monkeypatch.setattr(trainer, "rl_step", _signal_at(1))
    previous = signal.signal(signal.SIGTERM, run_guard._raise_terminated)  # as cli.main_guard sets it
    try:
        with pytest.raises(run_guard.Terminated):
            trainer.run_rl(config, str(tmp_path))
        assert sent and time.perf_counter() - sent[0] < 10 and not release.is_set()
    finally:
        release.set()
        signal.signal(signal.SIGTERM, previous)
    assert state_dir.is_dir() and not (tmp_path / "offpolicy" / "batch_2.npz").exists()


def test_an_exception_in_the_step_returns_without_waiting_for_the_batch_in_flight(tmp_path, monkeypatch):
    config = _tiny(**{"train.steps": 4, "train.off_policy_steps": 1})
    release, raised = threading.Event(), []
    real_step = trainer.rl_step

    def fails_after_step_1_started_batch_2(ctx, state, step, collect):
        out = real_step(ctx, state, step, collect)
        if step == 1:
            raised.append(time.perf_counter())
            raise RuntimeError("boom")
        return out
    monkeypatch.setattr(trainer, "collect_phases", _slowed(2, lambda: release.wait(30)))
    monkeypatch.setattr(trainer, "rl_step", fails_after_step_1_started_batch_2)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            trainer.run_rl(config, str(tmp_path))
        assert time.perf_counter() - raised[0] < 5 and not release.is_set()
    finally:
        release.set()


# --------------------------------------------------------------------------------------------- k >= 2

def test_k2_killed_and_resumed_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    """A checkpoint at step 2 holds batches 2 and 3 (sampled by the policies of steps 0 and 1): the resumed run
    trains on them (staleness 2, 2), not on a fresh batch 3 (staleness 0)."""
    config = _tiny(**{"train.steps": 4, "train.off_policy_steps": 2})
    full = trainer.run_rl(config, str(tmp_path / "full"))
    m = _metrics(tmp_path / "full")
    assert [m[(t, "rl/staleness")] for t in range(4)] == [0.0, 0.0, 2.0, 2.0]
    real_step = trainer.rl_step

    def dies_at_step_2(ctx, state, step, collect):
        if step == 2:
            raise KeyboardInterrupt  # after the checkpoint at 2, with batches 2 and 3 in flight
        return real_step(ctx, state, step, collect)
    monkeypatch.setattr(trainer, "rl_step", dies_at_step_2)
    with pytest.raises(KeyboardInterrupt):
        trainer.run_rl(config, str(tmp_path / "resumed"))
    assert sorted(os.listdir(tmp_path / "resumed" / "offpolicy")) == ["batch_2.npz", "batch_3.npz"]
    monkeypatch.setattr(trainer, "rl_step", real_step)
    resumed = trainer.run_rl(config, str(tmp_path / "resumed"))
    assert _metrics(tmp_path / "resumed") == m
    for a, b in zip(jax.tree.leaves(resumed.state["params"]), jax.tree.leaves(full.state["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
