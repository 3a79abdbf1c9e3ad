import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax

from sage_jax.bench import workloads
from sage_jax.models import decoder as model
from sage_jax.plan import padding as packing_report
from sage_jax.rl import guides, objectives, packing
from sage_jax.training import state as train_state
from sage_jax.bench.common import OPTIM
from sage_jax.run import config as config_lib
from tests.tolerances import decoder_terms, f32_tols

CFG = model.preset("tiny", attention="naive", attention_block=64)
# Packed rows against padded ones (and slices, micro-batches) sum the same terms in other orders (tests/tolerances.py):
# log-probs and entropies of order 1 (the floor) through CFG over 64 positions: rtol 6.1e-5, 4.4e-4 at -log 512;
# against real defects (measured): a token that sees another packed sequence moves by up to 0.8, a log-prob at the
# wrong temperature by 0.35, 600x and more. Gradients add the sum over the batch's tokens, floored at each leaf's size.
TOLS = f32_tols(decoder_terms(CFG, 64), floor=1.0)
LOSS = objectives.LossConfig(kl_estimator="k3", beta=0.05, guide=guides.GuideConfig(name="branch"))


def _padded_batch(N=8, P=16, C=48, seed=0):
    """Rows with left-padded prompts of 3..P tokens and right-padded completions of 0..C tokens."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(3, P + 1, N)
    comp_lens = np.concatenate([[C, 0], rng.integers(1, C, N - 2)])
    tokens = rng.integers(2, CFG.vocab_size, (N, P + C)).astype(np.int32)
    prompt_mask = np.arange(P)[None] >= (P - prompt_lens)[:, None]
    comp_mask = np.arange(C)[None] < comp_lens[:, None]
    tokens = np.where(np.concatenate([prompt_mask, comp_mask], 1), tokens, 0)
    near = lambda: (-np.log(CFG.vocab_size) + 0.1 * rng.standard_normal((N, C))).astype(np.float32) * comp_mask
    return {"tokens": tokens, "mask": np.concatenate([prompt_mask, comp_mask], 1).astype(np.int32),
            "completion_mask": comp_mask.astype(np.float32), "advantages": rng.standard_normal(N).astype(np.float32),
            "ref_logp": near(), "old_logp": near(), "sampler_logp": near(), "truncated": comp_lens == C}


@pytest.fixture(scope="module")
def params():
    return model.init_params(CFG, jax.random.key(0))


def _rows(a, packed):
    """A packed per-row array back in the padded batch's row order, on the host."""
    return np.asarray(packing.to_rows(jnp.asarray(a), packed["row_index"]))


def test_pack_layout_holds_every_token_once():
    batch = _padded_batch()
    packed = packing.pack(batch, slices=2, rows_multiple=2)
    S, R, L = packed["tokens"].shape
    assert S == 2 and R % 2 == 0 and R * L <= 4 * 64 and R * L * L <= 4 * 64 * 64
    assert int((packed["segment_ids"] > 0).sum()) == int(batch["mask"].sum())
    assert packed["completion_mask"].shape == (2, 4, 48)
    np.testing.assert_array_equal(np.sort(packed["row_index"].reshape(-1)), np.arange(8))
    np.testing.assert_array_equal(_rows(packed["advantages"], packed), batch["advantages"])
    # the gathered position's next token is the completion token it predicts
    flat = packed["tokens"].reshape(2, -1)
    nxt = _rows(np.take_along_axis(flat, packed["gather"].reshape(2, -1) + 1, 1).reshape(2, 4, 48), packed)
    comp = batch["completion_mask"] > 0
    np.testing.assert_array_equal(nxt[comp], batch["tokens"][:, 16:][comp])
    # positions restart per sequence and each segment is one row's prompt + completion
    seg, pos = packed["segment_ids"], packed["positions"]
    lens = sorted(int(n) for n in batch["mask"].sum(1))
    got = sorted(int(((seg[s, r] == k)).sum()) for s in range(S) for r in range(R) for k in range(1, seg.max() + 1)
                 if (seg[s, r] == k).any())
    assert got == lens and (pos[seg == 0] == 0).all()


@pytest.mark.parametrize("impl,slices", [("naive", 1), ("blockwise", 2)])
def test_packed_logprobs_equal_padded(params, impl, slices):
    cfg = CFG.replace(attention=impl)
    batch = _padded_batch()
    ref, ref_ent = train_state.sequence_logprobs_pass(cfg, params, batch["tokens"], batch["mask"], prompt_len=16,
                                                  temperature=0.7)
    packed = jax.tree.map(jnp.asarray, packing.pack(batch, slices=slices))
    got, got_ent = packing.sequence_logprobs(cfg, params, packed, temperature=0.7)
    comp = batch["completion_mask"] > 0
    np.testing.assert_allclose(_rows(got, packed)[comp], np.asarray(ref)[comp], **TOLS)
    np.testing.assert_allclose(_rows(got_ent, packed)[comp], np.asarray(ref_ent)[comp], **TOLS)


def test_packed_loss_and_gradients_equal_padded(params):
    batch = _padded_batch()
    loss = lambda fn, b: jax.value_and_grad(fn, has_aux=True)(params, b, CFG.replace(attention="blockwise"), LOSS,
                                                            3, jax.random.key(1))
    (l_ref, m_ref), g_ref = loss(objectives.loss_fn, jax.tree.map(jnp.asarray, batch))
    (l_got, m_got), g_got = loss(packing.loss_fn, jax.tree.map(jnp.asarray, packing.pack(batch, slices=2)))
    np.testing.assert_allclose(l_got, l_ref, rtol=1e-5, atol=1e-6)
    for k in m_ref:
        np.testing.assert_allclose(m_got[k], m_ref[k], rtol=1e-4, atol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, **f32_tols(decoder_terms(CFG, 64) + batch["mask"].size, floor=np.abs(b).max()))


def test_packed_train_step_runs_with_grad_accum(params):
    """train_state.make_train_step takes the packed loss; micro-batches split the slice axis."""
    tx, schedule = train_state.make_optimizer(OPTIM, 10)
    step = train_state.make_train_step(CFG, LOSS, tx, schedule, seed=0, grad_accum=2, loss_fn=packing.loss_fn)
    packed = packing.pack(_padded_batch(), slices=2)
    state = train_state.init_state(jax.tree.map(jnp.copy, params), tx)  # the step donates it
    state, metrics = step(state, dict(packed, rl_step=np.int32(0)))
    assert np.isfinite(float(metrics["loss/total"])) and int(state["step"]) == 1


def test_long_tail_packs_under_15_percent_padding():
    lengths = workloads.longtail_lengths(64, 512, seed=0)
    assert np.median(lengths) == pytest.approx(512 / 5, rel=0.2) and (lengths == 512).mean() >= 0.02
    N, P, C = 64, 32, 512
    batch = {"tokens": np.ones((N, P + C), np.int32), "completion_mask": np.arange(C)[None] < lengths[:, None]}
    batch["mask"] = np.concatenate([np.ones((N, P), bool), batch["completion_mask"]], 1).astype(np.int32)
    before, after = packing.padded_fraction(batch), packing.padded_fraction(packing.pack(batch))
    assert after <= 0.15 < before


def test_pack_rejects_what_it_cannot_pack():
    batch = _padded_batch()
    with pytest.raises(ValueError, match="slices"):
        packing.pack(batch, slices=3)
    with pytest.raises(ValueError, match="row_len"):
        packing.pack(batch, row_len=32)


def test_equal_lengths_pack_one_per_row():
    """Fixed-length rollouts: the packed batch computes exactly what the padded one does (no regression)."""
    N, T = 8, 40
    batch = {"tokens": np.ones((N, T), np.int32), "mask": np.ones((N, T), np.int32),
             "completion_mask": np.ones((N, 24), np.float32)}
    packed = packing.pack(batch)
    assert packed["tokens"].shape == (1, N, T) and packing.padded_fraction(packed) == 0.0


def test_no_grad_pass_in_slices_equals_one_pass(params):
    packed = jax.tree.map(jnp.asarray, packing.pack(_padded_batch(), slices=4))
    whole = packing.sequence_logprobs(CFG, params, packed, temperature=1.0)
    parts = packing.sequence_logprobs_in_passes(CFG, params, packed, temperature=1.0, rows_per_pass=4)
    for a, b in zip(parts, whole):  # 4 rows per pass against all: batches of other widths
        np.testing.assert_allclose(a, b, **TOLS)


def _sgd_delta(loss_fn, batch, params, grad_accum, loss_cfg):
    """-gradient (of the accumulated step) as the params' change under SGD with learning rate 1."""
    step = train_state.make_train_step(CFG.replace(attention="blockwise"), loss_cfg, optax.sgd(1.0), lambda s: 1.0,
                                       seed=0, grad_accum=grad_accum, loss_fn=loss_fn)
    state = train_state.init_state(jax.tree.map(jnp.copy, params), optax.sgd(1.0))  # the step donates it
    state, metrics = step(state, dict(jax.tree.map(jnp.asarray, batch), rl_step=np.int32(3)))
    return jax.tree.map(lambda a, b: a - b, state["params"], params), metrics


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
def test_grad_accum_gradients_equal_padded(params, aggregation):
    """Micro-batches of balanced slices hold other rows than the padded layout's strided ones: the accumulated
    gradient is the same for every aggregation (each micro-batch keeps the padded one's row count)."""
    loss_cfg = objectives.LossConfig(kl_estimator="k3", beta=0.05, aggregation=aggregation, norm_len=48)
    batch = _padded_batch(N=16, seed=3)
    want, m_want = _sgd_delta(None, batch, params, 4, loss_cfg)
    packed = packing.pack(batch, slices=4)
    assert not np.array_equal(packed["row_index"], np.arange(16).reshape(4, 4).T)  # not the padded micro-batches
    got, m_got = _sgd_delta(packing.loss_fn, packed, params, 4, loss_cfg)
    np.testing.assert_allclose(m_got["loss/total"], m_want["loss/total"], rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):  # deltas (p - g) - p: rounded at the norms' 1
        np.testing.assert_allclose(a, b, **f32_tols(decoder_terms(CFG, 64) + batch["mask"].size, floor=np.abs(b).max(),
                                                    rounded_at=1.0))


@pytest.mark.parametrize("config,devices", [("configs/qwen7b_branch.py", 32), ("configs/r1distill7b_branch.py", 64)])
def test_7b_layouts_pack_under_15_percent_padding(config, devices):
    """The paper configs' step (1,024 rows, 4-8 rows per device and micro-batch, long-tailed lengths): slices packed
    each on its own left most of every row empty (62% and 70% padded)."""
    r = packing_report.report(config_lib.load(config, []), devices, "longtail", prompt_len=256)
    assert r["len_p50"] == pytest.approx(r["len_max"] / 5, rel=0.2) and r["frac_at_max"] >= 0.02
    assert r["padded_frac_packed"] <= 0.15 < r["padded_frac_padded"]
    S, R, L = r["packed_shape"]
    n, T = r["rows"] // S, r["padded_shape"][1]
    assert S == r["slices"] and S % (r["data_parallel"] * r["grad_accum"]) == 0 and R * L <= n * T


def test_mini_batches_pack_within_their_own_slices():
    lengths = workloads.longtail_lengths(64, 512, seed=1)
    groups = np.random.default_rng(0).permutation(8).reshape(2, 4)
    row_groups = (groups[:, :, None] * 8 + np.arange(8)).reshape(2, -1)
    lay = packing.layout(32 + lengths, slices=8, width=544, row_groups=row_groups)
    for b in range(2):
        np.testing.assert_array_equal(np.sort(lay.row_index[4 * b:4 * (b + 1)].reshape(-1)), np.sort(row_groups[b]))


def test_packed_shapes_and_compiles_stay_bounded(params):
    """Many steps of random long-tailed lengths: every shape comes from the finite grid, few distinct ones occur,
    and the no-grad pass compiles once per shape."""
    rng = np.random.default_rng(0)
    N, P, C = 16, 8, 64
    before = packing.sequence_logprobs._cache_size()
    shapes = set()
    for _ in range(24):
        lengths = np.clip(np.ceil(rng.exponential(0.2 * C / np.log(2), N)), 1, C).astype(int)
        lengths[rng.integers(N)] = C
        batch = {"tokens": np.full((N, P + C), 5, np.int32), "completion_mask": np.arange(C)[None] < lengths[:, None]}
        batch["mask"] = np.concatenate([np.ones((N, P), bool), batch["completion_mask"]], 1).astype(np.int32)
        packed = packing.pack(batch, slices=2)
        S, R, L = packed["tokens"].shape
        assert L in packing.row_len_candidates(P + C, P + C, N // 2) and R * L <= (N // 2) * (P + C)
        shapes.add((R, L))
        packing.sequence_logprobs(CFG, params, {k: jnp.asarray(packed[k]) for k in packing.LAYOUT_KEYS[:-1]},
                                  temperature=1.0)
    assert len(shapes) <= 4
    assert packing.sequence_logprobs._cache_size() - before == len(shapes)


def test_bucket_rounds_up_by_at_most_an_eighth():
    xs = np.arange(1, 5000)
    b = np.array([packing.bucket(x) for x in xs])
    assert np.all(b >= xs) and np.all(b <= xs * 9 / 8) and np.all(b[:16] == xs[:16])
    assert len(set(b[(xs > 1024) & (xs <= 2048)])) == 8  # eight shapes per octave


def test_the_demo_steps_pack_into_few_shapes():
    """The CPU demo's step (256 rows of 16 + 24 tokens): row counts of 169-187 gave 15 shapes in 40 steps, each a
    new compile of the update and the passes (the demo's packed run took 7 minutes against 4)."""
    config = config_lib.load("configs/cpu_demo.py", [])
    steps = [packing_report.report(config, 1, prompt_len=16, seed=k, draw=True) for k in range(40)]
    assert len({tuple(r["packed_shape"]) for r in steps}) <= 3
    assert max(r["padded_frac_packed"] for r in steps) <= 0.25


def test_packing_report_cli(capsys):
    assert packing_report.main(["--config", "configs/tiny_test.py", "--devices", "2", "--workload", "longtail",
                                "--prompt-len", "8", "--config.rollout.max_new_tokens=64"]) == 0
    out = capsys.readouterr().out
    assert "16 rows" in out and "padded  [16 x 72]" in out and "packed  [2 x" in out
    with pytest.raises(ValueError, match="prompt-len"):
        packing_report.main(["--config", "configs/tiny_test.py", "--devices", "1", "--prompt-len", "4096"])


def test_fewer_micro_batches_where_the_configured_ones_are_mostly_padding(params):
    """One long completion among short ones: 4 micro-batches of 4 rows each need 2 rows of 64 per slice; 2 micro-batches
    of 8 rows pack into less (still under the 4-row budget). The update with 2 accumulated micro-batches equals the
    padded one with 4."""
    batch = _padded_batch(N=16, seed=5)
    comp_lens = np.concatenate([[48], np.random.default_rng(5).integers(1, 9, 15)])
    batch["completion_mask"] = (np.arange(48)[None] < comp_lens[:, None]).astype(np.float32)
    batch["mask"] = np.concatenate([batch["mask"][:, :16], batch["completion_mask"].astype(np.int32)], 1)
    batch["tokens"] = batch["tokens"] * batch["mask"]
    options = packing.slice_options(16, 2, data_parallel=1, grad_accum=4, mini_batches=1)
    assert options == [1, 2, 4]
    packed = packing.pack(batch, slices=options)
    S, R, L = packed["tokens"].shape
    assert S < 4 and S * R * L < packing.pack(batch, slices=4)["tokens"].size and R * L <= 4 * 64
    accum = packing.micro_batches(packed, data_parallel=1, grad_accum=4)
    assert accum == S
    want, _ = _sgd_delta(None, batch, params, 4, LOSS)
    got, _ = _sgd_delta(packing.loss_fn, packed, params, accum, LOSS)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):  # as in test_grad_accum_gradients_equal_padded
        np.testing.assert_allclose(a, b, **f32_tols(decoder_terms(CFG, 64) + batch["mask"].size, floor=np.abs(b).max(),
                                                    rounded_at=1.0))


def _long_tail_batch(lengths, P=8, C=512):
    N = len(lengths)
    comp = np.arange(C)[None] < np.asarray(lengths)[:, None]
    mask = np.concatenate([np.ones((N, P), bool), comp], 1)
    return {"tokens": np.where(mask, 3, 0).astype(np.int32), "mask": mask.astype(np.int32),
            "completion_mask": comp.astype(np.float32), "advantages": np.zeros(N, np.float32)}


def test_a_known_shape_within_a_bucket_step_is_reused_and_a_costly_one_is_not():
    """A step whose rows fit an already compiled (S, R, L) for at most 1/8 more positions takes it (a compile saved);
    a step that a new shape would serve for far less gets the new shape."""
    base = _long_tail_batch([500, 300, 200, 100, 90, 80, 70, 60])
    known: set = set()
    first = packing.pack(base, slices=[1, 2], known=known)
    known.add(packing.shape_key(first))
    fewer = _long_tail_batch([500, 300, 200, 100, 90, 80, 70, 20])  # a new layout would be a little smaller
    fresh = packing.pack(fewer, slices=[1, 2])
    reused = packing.pack(fewer, slices=[1, 2], known=known)
    assert packing.shape_key(reused) == packing.shape_key(first)
    assert fresh["tokens"].size <= reused["tokens"].size <= (1 + packing.MIN_SAVING) * fresh["tokens"].size
    assert int((reused["segment_ids"] > 0).sum()) == int(fewer["mask"].sum())  # every token once, the rest padding
    short = _long_tail_batch([60, 50, 40, 30, 30, 20, 20, 10])  # fits, but at several times a new shape's positions
    assert packing.shape_key(packing.pack(short, slices=[1, 2], known=known)) != packing.shape_key(first)
    other_width = _long_tail_batch([500, 300, 200, 100, 90, 80, 70, 20], C=256 + 256 // 2)
    assert packing.shape_key(packing.pack(other_width, slices=[1, 2], known=known))[4] == 384  # C is part of it


def test_a_reused_shape_gives_the_padded_loss(params, monkeypatch):
    batch = _padded_batch()
    S, R, L, n, C = packing.shape_key(packing.pack(batch, slices=2))
    monkeypatch.setattr(packing, "MIN_SAVING", 1.0)  # take a known shape at any cost
    packed = packing.pack(batch, slices=2, known={(S, R + 2, L, n, C)})  # two rows more than needed: padding
    assert packed["tokens"].shape == (S, R + 2, L)
    loss = lambda fn, b: fn(params, jax.tree.map(jnp.asarray, b), CFG, LOSS, 3, jax.random.key(1))
    (l_ref, m_ref), (l_got, m_got) = loss(objectives.loss_fn, batch), loss(packing.loss_fn, packed)
    np.testing.assert_allclose(l_got, l_ref, rtol=1e-5, atol=1e-6)


def test_a_partial_rollout_stream_compiles_fewer_shapes():
    """Steps that each train whichever 64 rows finished (a long tail, the longest below the budget in some steps):
    with the run's known shapes the stream packs into fewer distinct shapes, each step within 1/8 of its own best."""
    rng = np.random.default_rng(0)
    pool = workloads.longtail_lengths(512, 512, seed=1)
    known: set = set()
    fresh_keys, kept_keys = set(), set()
    for _ in range(16):
        batch = _long_tail_batch(rng.choice(pool, 64, replace=False), P=32)
        fresh = packing.pack(batch, slices=[1, 2, 4])
        kept = packing.pack(batch, slices=[1, 2, 4], known=known)
        known.add(packing.shape_key(kept))
        fresh_keys.add(packing.shape_key(fresh))
        kept_keys.add(packing.shape_key(kept))
        assert kept["tokens"].size <= (1 + packing.MIN_SAVING) * fresh["tokens"].size
    assert len(kept_keys) < len(fresh_keys)
