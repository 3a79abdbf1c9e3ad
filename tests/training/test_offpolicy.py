"""train.off_policy_steps: the pipeline's bookkeeping (which policy sampled which batch), k = 0 unchanged, resume
equality at k = 1 and the split placement (mesh.rollout_devices) against the colocated one."""

import json
import threading
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax.run import config as config_lib
from sage_jax.models import sharding
from sage_jax.training import offpolicy, trainer


def _tiny(**overrides):
    base = {"train.steps": 3, "train.ckpt_every": 1, "train.sample_every": 0, "train.use_tensorboard": False}
    return config_lib.load("configs/tiny_test.py", [f"--config.{k}={v}" for k, v in {**base, **overrides}.items()])


def _metrics(workdir) -> dict:
    """{(step, key): value} of metrics.jsonl without the timings (and what is derived from them)."""
    out = {}
    for line in open(workdir / "metrics.jsonl"):
        row = json.loads(line)
        out.update({(row["step"], k): v for k, v in row.items()
                    if not k.startswith("time") and k not in ("step", "perf/tokens_per_s")})
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
            self.collect = lambda params, step: collect.func(*collect.args[:3], collect.args[3].pool, params, step)
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
    real_collect, real_step = trainer.collect_rollouts, trainer.rl_step

    def collect(task, cfg, config, pool, params, step):
        sampled[step] = _fingerprint(params)
        return real_collect(task, cfg, config, pool, params, step)

    def rl_step(ctx, state, step, collect_fn):
        started[step] = _fingerprint(ctx.policy(state["params"]))
        return real_step(ctx, state, step, collect_fn)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer, "collect_rollouts", collect)
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
