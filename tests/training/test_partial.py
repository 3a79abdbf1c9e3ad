"""Partial rollouts (rollout.partial, training/partial.py): groups trained whole, carried rows as if never interrupted
(weights unchanged), each token's log-prob that of the policy that drew it (weights changed), max_lag's drops, the
carry through a checkpoint, and the trainer: the default unchanged, resume equality at k = 0 and 1, LoRA and the
split placement. Sharded on the suite's 8 simulated devices."""

import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax.models import decoder as model
from sage_jax.run import config as config_lib
from sage_jax.sampling import sampler
from sage_jax.training import partial, rollouts, trainer
from tests.sampling.test_sampler import CFG, _random_params
from tests.training.test_offpolicy import _metrics
from tests.tolerances import decoder_terms, f32_tols

G, B, NEW = 3, 2, 24
TEMPERATURE = 0.9
rng = np.random.default_rng(0)
STREAM = [list(map(int, rng.integers(2, CFG.vocab_size, rng.integers(1, 8)))) for _ in range(64)]
# long-tailed budgets (no EOS: they decide when each row stops): most rows short, a few run to NEW
BUDGETS = np.minimum(NEW, 1 + rng.geometric(0.15, 64 * G)).tolist()
# a carried row's cache is one prefill of prompt + tokens, not the decode steps that computed it: float32 rounding
# through at most 64 cache positions (the prompt bucket grows with the carried tokens), floor 1 nat
LOGP_TOLS = f32_tols(decoder_terms(CFG, 64), floor=1.0)


def _run(params_of, steps: int, oversample=1.5, max_lag=4, carry=None, start=0):
    """sample_partial over `steps` steps, version = step; params_of(version) -> params. -> per step (groups, dropped,
    the fresh prompts' cursor and count, key) and the carry."""
    carry = carry or partial.Carry()
    log = []
    for step in range(start, start + steps):
        key = jax.random.key(100 + step)
        seen = {}

        def fresh_prompts(cursor, n):
            seen.update(cursor=cursor, n=n)
            return STREAM[cursor:cursor + n], list(range(cursor, cursor + n))

        def generate(prompts, resume, stop_after_groups, limits, params=params_of(step), key=key):
            return sampler.generate(CFG, params, prompts, NEW, temperature=TEMPERATURE, eos_ids=(), seed=key,
                                    num_samples=G, row_max_new_tokens=limits, stop_after_groups=stop_after_groups,
                                    resume=resume)
        groups, dropped, drawn, _ = rollouts.run_phases(partial.sample_partial(
            carry, step, step, B, G, oversample, max_lag, fresh_prompts, generate, key, NEW,
            fresh_limits=lambda cursor, n: BUDGETS[cursor * G:(cursor + n) * G]))
        log.append(SimpleNamespace(step=step, groups=groups, dropped=dropped, drawn=drawn, key=key, **seen))
    return log, carry


@pytest.fixture(scope="module")
def params():
    return _random_params(CFG)


@pytest.fixture(scope="module")
def unchanged(params):
    return _run(lambda v: params, 6)


def test_groups_are_trained_whole_and_rows_carry(unchanged):
    log, carry = unchanged
    assert all(len(s.groups) == B for s in log)
    trained = [g for s in log for g in s.groups]
    assert len({g.label for g in trained}) == len(trained)  # no group twice
    for g in trained:
        assert g.complete and sorted(r.row_id % G for r in g.rows) == list(range(G))
        assert all(r.prompt == STREAM[g.example] for r in g.rows)
        assert all(len(r.tokens) == BUDGETS[g.example * G + r.row_id % G] for r in g.rows)  # each ran to its end
    # some rows left their pool and came back: tokens drawn by more than one call (here: one version per call)
    assert any(len(set(r.versions.tolist())) > 1 for g in trained for r in g.rows)
    assert carry.carried_rows() > 0
    started = sum(s.n for s in log if "n" in s.__dict__)
    assert started == len(trained) + len(carry.groups) + sum(s.dropped for s in log)


def test_with_unchanged_weights_carried_rows_equal_an_uninterrupted_generation(unchanged, params):
    """Bit for bit in tokens, the log-probs within float tolerance, for every group of every step's call."""
    log, _ = unchanged
    by_label = {g.label: g for s in log for g in s.groups}
    checked = 0
    for s in log:
        if "n" not in s.__dict__:
            continue
        ref = jax.device_get(sampler.generate(
            CFG, params, STREAM[s.cursor:s.cursor + s.n], NEW, temperature=TEMPERATURE, eos_ids=(), seed=s.key,
            num_samples=G, row_max_new_tokens=BUDGETS[s.cursor * G:(s.cursor + s.n) * G]))
        for b in range(s.n):
            g = by_label.get((s.step, b))
            if g is None:
                continue
            for r in g.rows:
                n, L = r.row_id, len(r.tokens)
                np.testing.assert_array_equal(r.tokens, ref.tokens[n, :L])
                np.testing.assert_allclose(r.logp, ref.logprobs[n, :L], **LOGP_TOLS)
                checked += len(set(r.versions.tolist())) > 1
    assert checked > 0  # carried rows among them


def _teacher_forced(params, rows):
    """log softmax(logits / T) of each row's tokens under params (full forward, one row at a time)."""
    out = []
    fwd = jax.jit(model.forward, static_argnums=0)
    for r in rows:
        ids = jnp.asarray([r.prompt + r.tokens.tolist()])
        logp = jax.nn.log_softmax(fwd(CFG, params, ids)[0, len(r.prompt) - 1:-1] / TEMPERATURE, axis=-1)
        out.append(np.asarray(jnp.take_along_axis(logp, jnp.asarray(r.tokens)[:, None], axis=-1)[:, 0]))
    return out


def test_with_changing_weights_each_recorded_logprob_is_the_drawing_policys():
    versions = {v: _random_params(CFG, seed=10 + v) for v in range(4)}
    log, _ = _run(versions.__getitem__, 4)
    rows = [r for s in log for g in s.groups for r in g.rows]
    mixed = [r for r in rows if len(set(r.versions.tolist())) > 1]
    assert mixed, "no trained row was drawn by two policies"
    for v, params in versions.items():
        for r, ref in zip(rows, _teacher_forced(params, rows)):
            mine = r.versions == v
            np.testing.assert_allclose(r.logp[mine], ref[mine], **LOGP_TOLS)
    # and a carried token's recorded log-prob is not what the newer policy gives it
    r = mixed[0]
    later = _teacher_forced(versions[int(r.versions.max())], [r])[0]
    first = r.versions == r.versions.min()
    assert np.abs(r.logp[first] - later[first]).max() > 1e-2


@pytest.mark.parametrize("max_lag", [0, 1])
def test_max_lag_drops_and_counts_groups_too_old_to_train(params, max_lag):
    log, carry = _run(lambda v: params, 6, oversample=2.0, max_lag=max_lag)
    for s in log:
        for g in s.groups:
            assert all(s.step - int(r.versions.min()) <= max_lag for r in g.rows)
    dropped = sum(s.dropped for s in log)
    assert dropped > 0
    started = sum(s.n for s in log if "n" in s.__dict__)
    assert started == sum(len(s.groups) for s in log) + len(carry.groups) + dropped


def test_the_carry_through_its_bytes_continues_as_the_uninterrupted_run(unchanged, params):
    first, carry = _run(lambda v: params, 3)
    again = partial.Carry()
    again.load_bytes(carry.to_bytes())
    rest, _ = _run(lambda v: params, 3, carry=again, start=3)
    whole, _ = unchanged
    for a, b in zip(first + rest, whole):
        assert [g.label for g in a.groups] == [g.label for g in b.groups]
        for ga, gb in zip(a.groups, b.groups):
            for ra, rb in zip(ga.rows, gb.rows):
                np.testing.assert_array_equal(ra.tokens, rb.tokens)
                np.testing.assert_array_equal(ra.logp, rb.logp)
                np.testing.assert_array_equal(ra.versions, rb.versions)


# --------------------------------------------------------------------------------------------------- the trainer

def _tiny(**overrides):
    base = {"train.steps": 4, "train.ckpt_every": 2, "train.sample_every": 0, "train.use_tensorboard": False,
            "rollout.max_new_tokens": 32, "rollout.partial": True}
    return config_lib.load("configs/tiny_test.py", [f"--config.{k}={v}" for k, v in {**base, **overrides}.items()])


def _recording(monkeypatch, seen: list):
    real = trainer.rl_step

    def rl_step(ctx, state, step, collect):
        out = real(ctx, state, step, collect)
        seen.append((step, out.rollouts))
        return out
    monkeypatch.setattr(trainer, "rl_step", rl_step)


@pytest.fixture(scope="module")
def k0_run(tmp_path_factory):
    workdir, seen = tmp_path_factory.mktemp("partial_k0"), []
    with pytest.MonkeyPatch.context() as mp:
        _recording(mp, seen)
        result = trainer.run_rl(_tiny(), str(workdir))
    return SimpleNamespace(workdir=workdir, seen=seen, params=result.state["params"])


def test_trainer_trains_whole_groups_of_tokens_from_their_drawing_policies(k0_run):
    config = _tiny()
    Gs, Bs = config.rollout.group_size, config.rollout.prompts_per_step
    for step, ro in k0_run.seen:
        assert len(ro["golds"]) == Gs * Bs
        golds = np.array(ro["golds"], dtype=object).reshape(Bs, Gs)
        assert all(len(set(map(str, row))) == 1 for row in golds)  # each group one prompt
        lag = step - ro["versions"][ro["versions"] >= 0]
        assert lag.min() >= 0
    m = _metrics(k0_run.workdir)
    assert max(m[(t, "rl/carried_rows")] for t in range(4)) > 0
    assert max(m[(t, "rl/token_lag_max")] for t in range(4)) >= 1
    for t in range(4):
        assert {"rl/dropped_groups", "rl/token_lag_mean", "rl/ratio_mean"} <= {k for s, k in m if s == t}
    rows = [json.loads(line) for line in open(k0_run.workdir / "metrics.jsonl")]
    assert all(r["perf/gen_tokens_per_s"] > 0 for r in rows if "perf/gen_tokens_per_s" in r)


def test_the_default_is_unchanged(tmp_path, monkeypatch):
    """partial False: the collect of before (rollouts.collect_phases), on-policy, no partial-rollout keys; the same
    metrics as a config made before the fields existed."""
    monkeypatch.setattr(partial, "collect_phases", lambda *a, **k: pytest.fail("partial collect called"))
    trainer.run_rl(_tiny(**{"rollout.partial": False, "train.steps": 2}), str(tmp_path / "default"))
    old = _tiny(**{"train.steps": 2})
    with old.unlocked():
        for key in ("partial", "oversample", "max_lag"):
            del old.rollout[key]
    trainer.run_rl(old, str(tmp_path / "old"))
    m = _metrics(tmp_path / "default")
    assert m == _metrics(tmp_path / "old")
    assert not any(k.startswith(("rl/carried", "rl/token_lag", "rl/dropped")) for _, k in m)


def test_partial_rollouts_turned_off_at_resume_say_what_they_drop(k0_run, tmp_path, caplog):
    """Issue 50, item 15: with allow_config_change, a resume with rollout.partial=False does not use the carry the
    partial run saved; its rows are dropped with a warning that counts them, not silently."""
    import logging
    import shutil
    shutil.copytree(k0_run.workdir, tmp_path / "run")
    assert (tmp_path / "run" / "partial" / "carry_4.npz").exists()
    config = _tiny(**{"rollout.partial": False, "train.steps": 5, "train.allow_config_change": True})
    with caplog.at_level(logging.WARNING, logger="sage_jax"):
        trainer.run_rl(config, str(tmp_path / "run"))
    said = [r.getMessage() for r in caplog.records if "rollout.partial is off now" in r.getMessage()]
    assert len(said) == 1 and "at RL step 4" in said[0] and "carry_4.npz" in said[0], said
    assert " groups, " in said[0] and " rows (" in said[0] and "unfinished" in said[0], said[0]


@pytest.mark.parametrize("k", [0, 1])
def test_killed_and_resumed_equals_the_uninterrupted_run(k0_run, tmp_path, monkeypatch, k):
    config = _tiny(**{"train.off_policy_steps": k})
    if k == 0:
        whole = k0_run
    else:
        whole = SimpleNamespace(workdir=tmp_path / "whole")
        whole.params = trainer.run_rl(config, str(whole.workdir)).state["params"]
    real = trainer.rl_step

    def dies_at_step_2(ctx, state, step, collect):
        if step == 2:
            raise KeyboardInterrupt  # after the checkpoint at 2, rows in flight
        return real(ctx, state, step, collect)
    monkeypatch.setattr(trainer, "rl_step", dies_at_step_2)
    with pytest.raises(KeyboardInterrupt):
        trainer.run_rl(config, str(tmp_path / "run"))
    assert (tmp_path / "run" / "partial" / f"carry_{2 + k}.npz").exists()
    monkeypatch.setattr(trainer, "rl_step", real)
    resumed = trainer.run_rl(config, str(tmp_path / "run"))
    assert _metrics(tmp_path / "run") == _metrics(whole.workdir)
    for a, b in zip(jax.tree.leaves(resumed.state["params"]), jax.tree.leaves(whole.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_with_lora_and_on_a_rollout_sub_mesh(tmp_path):
    lora = trainer.run_rl(_tiny(**{"train.steps": 3, "model.lora.rank": 4}), str(tmp_path / "lora"))
    split = trainer.run_rl(_tiny(**{"train.steps": 3, "train.off_policy_steps": 1, "mesh.rollout_devices": 4}),
                           str(tmp_path / "split"))
    for run in ("lora", "split"):
        m = _metrics(tmp_path / run)
        assert all(np.isfinite(m[(t, "rl/ratio_mean")]) for t in range(3))
        assert max(m[(t, "rl/token_lag_max")] for t in range(3)) >= (1 if run == "split" else 0)
    assert lora.summary is not None and split.summary is not None


def test_config_refuses_what_partial_rollouts_cannot_do():
    for bad, words in [({"train.off_policy_steps": 2}, "off_policy_steps 0 or 1"),
                       ({"train.off_policy_steps": 1, "rollout.max_lag": 0}, "max_lag=0"),
                       ({"train.dynamic_sampling": True}, "dynamic_sampling"),
                       ({"rollout.oversample": 0.5}, "oversample")]:
        with pytest.raises(config_lib.ConfigError, match=words):
            config_lib.validate(_tiny(**bad))
