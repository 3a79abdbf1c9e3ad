import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax.run import config as config_lib
from sage_jax.rl import objectives
from sage_jax.training import state as train_state, trainer
from sage_jax.models import build
from tests.tolerances import decoder_terms, f32_tols

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tiny(**overrides):
    return config_lib.load("configs/tiny_test.py", [f"--config.{k}={v}" for k, v in overrides.items()])


def _fake_batch(cfg, N=8, P=6, C=5, seed=0):
    rng = np.random.RandomState(seed)
    tokens = rng.randint(3, cfg.vocab_size, (N, P + C)).astype(np.int32)
    comp_mask = (np.arange(C)[None] < rng.randint(1, C + 1, (N, 1))).astype(np.float32)
    mask = np.concatenate([np.ones((N, P), np.int32), comp_mask.astype(np.int32)], 1)
    return {"tokens": jnp.asarray(tokens), "mask": jnp.asarray(mask), "completion_mask": jnp.asarray(comp_mask),
            "advantages": jnp.asarray(rng.randn(N).astype(np.float32)),
            "ref_logp": jnp.asarray(-2.0 - rng.rand(N, C).astype(np.float32)),
            "sampler_logp": jnp.zeros((N, C)), "truncated": jnp.zeros((N,), bool),
            "rl_step": jnp.asarray(0, jnp.int32)}


def test_one_train_step_changes_params_and_reports_metrics():
    config = _tiny()
    cfg = build.model_config(config, vocab_size=23)
    params = jax.jit(lambda: __import__("sage_jax.models.decoder", fromlist=["x"]).init_params(cfg, jax.random.key(0)))()
    before = jax.tree.map(np.asarray, params)
    tx, schedule = train_state.make_optimizer(config.optim, 10)
    state = train_state.init_state(params, tx)
    loss_cfg = objectives.LossConfig.from_config(config.loss, total_steps=10)
    step = train_state.make_train_step(cfg, loss_cfg, tx, schedule, seed=0)
    state, metrics = step(state, _fake_batch(cfg))
    metrics = jax.device_get(metrics)
    assert np.isfinite(metrics["loss/total"])
    for key in ("rl/kl", "rl/entropy", "sage/q_mean", "sage/q_max", "rl/clip_frac_high", "opt/grad_norm"):
        assert key in metrics, key
    changed = [not np.allclose(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state["params"]))]
    assert all(changed)
    assert int(state["step"]) == 1


def test_grad_accumulation_matches_full_batch():
    import optax
    config = _tiny()
    cfg = build.model_config(config, vocab_size=23)
    from sage_jax.models import decoder as model
    params = model.init_params(cfg, jax.random.key(0))
    batch = _fake_batch(cfg)
    # seq-mean-token-mean over equal micro-batches averages to the full-batch loss and gradient: the same float32 sums
    # in another order. SGD with learning rate 1 reads the gradient back as the params' change (Adam's first step
    # divides a near-zero gradient by its own size: no reduction length bounds that).
    loss_cfg = objectives.LossConfig.from_config(config.loss.to_dict() | {"guide": "none"})
    outs = []
    for accum in (1, 2):
        tx = optax.sgd(1.0)
        state = train_state.init_state(jax.tree.map(jnp.copy, params), tx)
        step = train_state.make_train_step(cfg, loss_cfg, tx, lambda count: 1.0, seed=0, grad_accum=accum)
        state, m = step(state, batch)
        outs.append((jax.tree.map(lambda a, b: a - b, state["params"], params), m))
    terms = decoder_terms(cfg, batch["tokens"].shape[1]) + batch["completion_mask"].size
    for key in ("loss/total", "opt/grad_norm"):
        np.testing.assert_allclose(outs[0][1][key], outs[1][1][key], **f32_tols(terms))
    # a metric's token mean is averaged over the micro-batches, whose completion lengths differ: not the full batch's
    # token mean by definition (3e-4 relative here), so it is only checked to be that average's neighbour
    np.testing.assert_allclose(outs[0][1]["rl/entropy"], outs[1][1]["rl/entropy"], rtol=1e-2)
    for a, b in zip(jax.tree.leaves(outs[0][0]), jax.tree.leaves(outs[1][0])):  # -gradients, read back at |p|
        np.testing.assert_allclose(a, b, **f32_tols(terms, floor=np.abs(b).max(),
                                                     rounded_at=max(float(np.abs(x).max()) for x in jax.tree.leaves(params))))


def test_dynamic_sampling_filters_groups_on_accuracy_not_on_shaped_rewards(monkeypatch):
    # attempt 0: group 0 is all correct but one rollout runs into the overlong buffer (its rewards differ only by
    # the penalty), group 1 is mixed; attempt 1: two mixed groups. DAPO keeps groups whose accuracy varies.
    config = _tiny(**{"rollout.prompts_per_step": 2, "rollout.group_size": 2, "rollout.max_new_tokens": 10,
                      "train.dynamic_sampling": True, "train.max_resample": 1, "train.overlong_buffer": 4})
    attempts = {0: (["1", "1", "1", "0"], [2, 9, 3, 3]), 1: (["1", "0", "0", "1"], [3, 3, 3, 3])}

    def fake_rollout(task, cfg, params, examples, ro_cfg, key, max_prompt_len):
        texts, lengths = attempts[len(calls)]
        calls.append(examples)
        n = len(texts)
        return {"prompt_tokens": np.ones((n, 2), np.int32), "prompt_mask": np.ones((n, 2), bool),
                "tokens": np.ones((n, 10), np.int32), "lengths": np.array(lengths), "finished": np.ones(n, bool),
                "sampler_logp": np.zeros((n, 10), np.float32), "texts": list(texts), "golds": ["1"] * n,
                "prompts": ["p"] * n}

    class Pool:
        def score(self, texts, golds):
            return np.array([float(t == g) for t, g in zip(texts, golds)], np.float32)

        def take_counts(self):
            return {}

    class Task:
        def train_batch(self, index, size, seed):
            return [index] * size

    def fake_rollout_phases(*args):  # collect_rollouts runs rollouts.rollout in phases
        yield trainer.rollouts.HOST
        return fake_rollout(*args)

    calls = []
    monkeypatch.setattr(trainer.rollouts, "rollout_phases", fake_rollout_phases)
    cfg = build.model_config(config, vocab_size=23)
    ro, stats = trainer.collect_rollouts(Task(), cfg, config, Pool(), None, 0)
    assert len(calls) == 2 and stats["rl/resample_rounds"] == 1.0
    assert ro["texts"] == ["1", "0", "1", "0"]  # attempt 0's mixed group, then attempt 1's first one


def _run(workdir, *overrides, check=True, timeout=600):
    cmd = [sys.executable, "-m", "sage_jax.train", "--config", "configs/tiny_test.py", "--workdir", str(workdir),
           *overrides]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=check)


def _final_params(workdir, step):
    from sage_jax.run import checkpoint
    ck = checkpoint.Checkpointer(os.path.join(workdir, "rl"))
    _, state, _ = ck.restore_raw(step)
    ck.close()
    return state["params"]


def test_rl_steps_raise_reward_on_fixed_problems(tmp_path):
    """SFT a tiny model, then 8 GRPO+Branch steps: the sampled reward on the same problems (same seed) goes up."""
    from sage_jax.data import tasks
    from sage_jax.training import rollouts, supervised
    from sage_jax.rewards.pool import RewardPool
    c = _tiny(**{"sft.steps": 150, "sft.lr": 3e-3, "train.steps": 8, "rollout.prompts_per_step": 16,
                 "rollout.group_size": 8, "optim.lr": 2e-4, "train.ckpt_every": 100, "model.hidden_size": 128,
                 "model.intermediate_size": 256, "data.num_train": 64})
    task = tasks.build(c)
    cfg, params = supervised.run_sft(c, str(tmp_path / "sft"))

    def mean_reward(p):
        ro = rollouts.rollout(task, cfg, p, task.train[:64], c.rollout, jax.random.key(123), 32)
        with RewardPool("countdown", num_workers=0) as pool:
            return float(pool.score(ro["texts"], ro["golds"]).mean())
    before = mean_reward(params)
    after = mean_reward(trainer.run_rl(c, str(tmp_path), params_override=params).state["params"])
    assert 0.2 < before < 0.95
    assert after > before + 0.02, (before, after)


def test_sigkill_and_resume_equals_uninterrupted(tmp_path):
    steps = ["--config.train.steps=4", "--config.train.ckpt_every=1"]
    _run(tmp_path / "full", *steps)
    workdir = tmp_path / "killed"
    cmd = [sys.executable, "-m", "sage_jax.train", "--config", "configs/tiny_test.py", "--workdir", str(workdir),
           *steps]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (workdir / "rl" / "checkpoints" / "2" / "commit_success.txt").exists():
        assert proc.poll() is None and time.time() < deadline, "run ended before its second checkpoint"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _run(workdir, *steps)
    a, b = _final_params(tmp_path / "full", 4), _final_params(workdir, 4)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


def test_corrupt_latest_checkpoint_falls_back(tmp_path, caplog):
    _run(tmp_path, "--config.train.steps=2", "--config.train.ckpt_every=1")
    step2 = tmp_path / "rl" / "checkpoints" / "2"
    for f in (step2 / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    r = _run(tmp_path, "--config.train.steps=3", "--config.train.ckpt_every=1")
    assert "step 2" in r.stderr or "2" in r.stderr
    assert (tmp_path / "rl" / "checkpoints" / "3").exists()
    log = (tmp_path / "log.txt").read_text()
    assert "resumed" in log and "RL step 1" in log


def test_cli_errors_are_one_clear_line(tmp_path):
    r = _run(tmp_path / "a", "--config.loss.betta=1", check=False)
    assert r.returncode == 2 and "unknown config key 'loss.betta'" in r.stderr and "Traceback" not in r.stderr
    r = _run(tmp_path / "b", "--config.model.path=/nonexistent/model", check=False)
    assert r.returncode == 2 and "/nonexistent/model" in r.stderr and "Traceback" not in r.stderr
    r = _run(tmp_path / "c", "--config.mesh.shape=3,1,1", check=False)
    assert r.returncode == 2 and "mesh shape" in r.stderr and "Traceback" not in r.stderr


def test_summary_writes_json_and_a_before_after_plot(tmp_path):
    table = {"pass@1": 0.25, "pass@4": 0.5}
    summary = trainer.Summary(str(tmp_path / "summary.json"))
    summary.update(before={**table, "datasets": {"countdown": table}})
    summary.update(after={**table, "datasets": {"countdown": {"pass@1": 0.3, "pass@4": 0.5}}})
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["before"]["pass@1"] == 0.25 and written["after"]["datasets"]["countdown"]["pass@1"] == 0.3
    assert (tmp_path / "pass_at_k.png").read_bytes()[:4] == b"\x89PNG"
    assert trainer.Summary(str(tmp_path / "summary.json")).data == written  # a resumed run reads it back


def test_nonfinite_update_is_dropped():
    config = _tiny()
    cfg = build.model_config(config, vocab_size=23)
    from sage_jax.models import decoder as model
    params = model.init_params(cfg, jax.random.key(0))
    before = jax.tree.map(np.asarray, params)
    tx, schedule = train_state.make_optimizer(config.optim, 10)
    loss_cfg = objectives.LossConfig.from_config(config.loss, total_steps=10)
    step = train_state.make_train_step(cfg, loss_cfg, tx, schedule, seed=0)
    batch = dict(_fake_batch(cfg), advantages=jnp.full((8,), jnp.inf))
    state, metrics = step(train_state.init_state(params, tx), batch)
    assert float(metrics["opt/nonfinite_update"]) == 1.0 and int(state["step"]) == 0
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state["params"])):
        np.testing.assert_array_equal(a, b)
    state, metrics = step(state, _fake_batch(cfg))
    assert float(metrics["opt/nonfinite_update"]) == 0.0 and int(state["step"]) == 1


def test_nan_run_leaves_a_checkpoint_that_a_sane_rerun_resumes(tmp_path):
    from sage_jax.run import checkpoint
    from sage_jax.run.metrics_log import NonFiniteLossError
    trainer.run_rl(_tiny(**{"train.steps": 1}), str(tmp_path))
    with pytest.raises(NonFiniteLossError, match=r"at step 2 .*last good checkpoint: step 1 in "):
        trainer.run_rl(_tiny(**{"train.steps": 3, "optim.lr": 1e30, "train.allow_config_change": True}),
                       str(tmp_path))
    ck = checkpoint.Checkpointer(tmp_path / "rl")
    assert ck.all_steps() == [1]  # step 2 was finite but led to the NaN: moved aside
    for s in ck.all_steps():
        assert all(np.isfinite(x).all() for x in jax.tree.leaves(ck.restore_raw(s)[1]))
    ck.close()
    result = trainer.run_rl(_tiny(**{"train.steps": 3}), str(tmp_path))
    assert int(result.state["step"]) == 3
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rows}) == [0, 1, 2]
    assert all(r.get("rl/reward_timeouts") == 0.0 for r in rows if "rl/reward" in r)


def test_hf_export_loads_in_transformers_and_round_trips_a_prompt(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from sage_jax.data import tasks
    from sage_jax.models import decoder as model
    config = _tiny(**{"train.steps": 1, "train.export_hf": True})
    result = trainer.run_rl(config, str(tmp_path))
    out = tmp_path / "hf_export"
    tok = AutoTokenizer.from_pretrained(out)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ours = tasks.build(config).tokenizer
    prompt = "3 5 7 => 12: (3+5)*7"
    ids = tok(prompt).input_ids
    assert ids == ours.encode(prompt) and tok.decode(ids, skip_special_tokens=True) == prompt
    assert hf.generation_config.eos_token_id == ours.eos_ids[0] and tok.eos_token_id == ours.eos_ids[0]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits.numpy()
    expected = model.forward(result.cfg, result.state["params"], jnp.asarray([ids]))
    # torch vs JAX: the same sums in other orders, logits of order 1 (the floor; tests/tolerances.py)
    np.testing.assert_allclose(logits, np.asarray(expected), **f32_tols(decoder_terms(result.cfg, len(ids)), floor=1.0))
    generated = hf.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)[0, len(ids):].tolist()
    assert isinstance(tok.decode(generated, skip_special_tokens=True), str)


def test_resume_with_another_model_names_the_fields(tmp_path):
    """The settings are compared before the weights (issue 50, item 16): the changed model fields are named."""
    trainer.run_rl(_tiny(**{"train.steps": 1}), str(tmp_path))
    with pytest.raises(config_lib.ConfigError,
                       match=r"model.hidden_size: checkpoint 64, now 32; model.intermediate_size: checkpoint 128"):
        trainer.run_rl(_tiny(**{"train.steps": 2, "model.hidden_size": 32, "model.intermediate_size": 64}),
                       str(tmp_path))


def test_sft_checkpoints_every_k_steps_and_resumes(tmp_path, caplog):
    import logging
    import shutil
    from sage_jax.run import checkpoint
    from sage_jax.training import supervised
    caplog.set_level(logging.INFO, logger="sage_jax")
    config = _tiny(**{"sft.steps": 6, "sft.ckpt_every": 2, "sft.batch_size": 8})
    _, full = supervised.run_sft(config, str(tmp_path))
    full = jax.tree.map(np.asarray, full)
    ck = checkpoint.Checkpointer(tmp_path)
    assert ck.all_steps() == [4, 6]
    ck.close()
    # as if killed between the checkpoints at steps 4 and 6: the rerun resumes at 4 and ends where the first did
    shutil.rmtree(tmp_path / "checkpoints" / "6")
    _, resumed = supervised.run_sft(config, str(tmp_path))
    assert "SFT resumed at step 4" in caplog.text
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(resumed)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def _forced_rollouts(N=16, P=8, C=16, seed=0):
    """Scored rollouts (trainer.rl_step's CollectFn layout) with short, unequal lengths, so packing pays."""
    rng = np.random.default_rng(seed)
    prompt_lens = np.repeat(rng.integers(2, 5, N // 4), 4)
    prompt_mask = np.arange(P)[None] >= (P - prompt_lens)[:, None]
    lengths = rng.integers(1, 9, N).astype(np.int32)
    comp_mask = np.arange(C)[None] < lengths[:, None]
    rewards = rng.integers(0, 2, N).astype(np.float32)
    return {"prompt_tokens": np.where(prompt_mask, rng.integers(3, 23, (N, P)), 0).astype(np.int32),
            "prompt_mask": prompt_mask, "tokens": np.where(comp_mask, rng.integers(3, 23, (N, C)), 0).astype(np.int32),
            "lengths": lengths, "finished": np.ones(N, bool), "correct": rewards, "rewards": rewards,
            "sampler_logp": np.where(comp_mask, -3.0, 0.0).astype(np.float32),
            "texts": [""] * N, "golds": [""] * N, "prompts": [""] * N}


@pytest.mark.parametrize("overrides", [
    {"optim.mini_batches": 2, "optim.grad_accum": 2, "loss.kl_in_reward": True},
    {"optim.grad_accum": 2, "loss.kl_estimator": "forward-seq", "loss.aggregation": "token-mean"},
])
def test_packed_rl_step_equals_padded(overrides):
    """One RL step over 2 data-parallel devices, micro-batches, mini-batches and the KL terms computed per group
    outside the loss: the packed layout (rows balanced over slices, not in their order) updates the params as the
    padded one does. SGD, so the update is the gradient itself."""
    import optax
    from types import SimpleNamespace
    from sage_jax.models import sharding
    from sage_jax.rl import packing
    tokenizer = SimpleNamespace(vocab_size=23, eos_ids=[1], pad_id=0, bos_id=2)
    mesh = sharding.make_mesh((1, 2, 1), jax.devices()[:2])
    ro = _forced_rollouts()
    out = {}
    for packed in (False, True):
        config = _tiny(**overrides, **{"train.packing": packed, "optim.grad_clip": 0.0})
        rules = dict(config.mesh.rules)
        with jax.set_mesh(mesh), sharding.use_rules(rules):
            ctx, state = trainer.setup_rl(config, mesh, rules, tokenizer)
            tx = optax.sgd(0.1)
            make = lambda accum: train_state.make_train_step(ctx.cfg, ctx.loss_cfg, tx, lambda s: 0.1, config.seed,
                                                             accum, loss_fn=packing.loss_fn if packed else None)
            ctx = dataclasses.replace(ctx, train_step=trainer._train_steps(make, config.optim.grad_accum, 2))
            state = train_state.init_state(jax.tree.map(jnp.copy, state["params"]), tx)
            res = trainer.rl_step(ctx, state, 0, lambda params, step: (ro, {}))
            out[packed] = jax.device_get((res.state["params"], res.metrics, res.host))
    (p_pad, m_pad, h_pad), (p_pack, m_pack, h_pack) = out[False], out[True]
    assert h_pack["perf/padded_frac"] < h_pad["perf/padded_frac"] - 0.2  # it did pack
    np.testing.assert_allclose(m_pack["loss/total"], m_pad["loss/total"], rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(p_pack), jax.tree.leaves(p_pad)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_train_steps_follow_the_packed_micro_batch_count():
    made = []

    def make(accum):
        made.append(accum)
        return lambda state, batch: (state, accum)
    step = trainer._train_steps(make, grad_accum=8, data_parallel=2)
    packed = lambda S: {"tokens": np.zeros((S, 1, 4)), "segment_ids": np.zeros((S, 1, 4))}
    assert [step(None, packed(S))[1] for S in (4, 16, 4)] == [2, 8, 2]
    assert step(None, {"tokens": np.zeros((6, 4))})[1] == 8  # padded: the configured count
    assert made == [2, 8]  # one step per count, made once


def test_phase_timings_wait_for_the_device_and_add_up_to_the_step():
    """time/update_s holds the update's device work: against the same update re-timed with a block after every
    train_step (same run, a ratio), not the dispatch alone; the laps add up to time/step_s."""
    import time as time_lib
    from types import SimpleNamespace
    from sage_jax.models import sharding
    tokenizer = SimpleNamespace(vocab_size=23, eos_ids=[1], pad_id=0, bos_id=2)
    mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
    config = _tiny(**{"model.hidden_size": 256, "model.intermediate_size": 1024, "model.num_layers": 4,
                      "optim.num_iterations": 2})
    rules = dict(config.mesh.rules)
    ro = _forced_rollouts(N=32, P=8, C=64)
    collect = lambda params, step: (ro, {})
    with jax.set_mesh(mesh), sharding.use_rules(rules):
        ctx, state = trainer.setup_rl(config, mesh, rules, tokenizer)
        state = trainer.rl_step(ctx, state, 0, collect).state  # compiles
        res = trainer.rl_step(ctx, state, 1, collect)
        blocked = []

        def timed_step(state, mb, *base):
            t0 = time_lib.perf_counter()
            out = jax.block_until_ready(ctx.train_step(state, mb, *base))
            blocked.append(time_lib.perf_counter() - t0)
            return out
        trainer.rl_step(dataclasses.replace(ctx, train_step=timed_step), res.state, 2, collect)
    h = res.host
    phases = [v for k, v in h.items() if k.startswith("time/") and k.endswith("_s") and k != "time/step_s"]
    assert {"time/rollout_s", "time/batch_s", "time/ref_s", "time/old_s", "time/update_s"} <= set(h)
    assert abs(sum(phases) - h["time/step_s"]) <= 1e-6 * h["time/step_s"]
    assert h["time/update_s"] > 0.5 * sum(blocked), (h["time/update_s"], blocked)
