"""Rows that leave the pool and come back (sampling/rows.py): generate's stop_after_groups and resume."""

import jax
import numpy as np
import pytest

from sage_jax.models import decode_forms, sharding
from sage_jax.sampling import decode_pool, rows, sampler
from tests.sampling.test_sampler import CFG, PROMPTS, _np, _random_params, _recomputed_logprobs
from tests.tolerances import decoder_terms, f32_tols

G = 3
# 4 prompts x 3 samples; no EOS: these budgets decide when each row, and so each group, stops
LIMITS = [24, 24, 20, 2, 3, 1, 20, 5, 18, 4, 6, 2]  # groups' longest rows: 24, 3, 20, 6
LIMITS_ARR = np.array(LIMITS)
FRESH = [[40, 41, 42], [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 1, 2, 3, 4]]
SAMPLING = dict(temperature=0.9, top_p=0.95)


@pytest.fixture(scope="module")
def params():
    return _random_params(CFG)


def _groups_done(out, G):
    return out["done"][:len(out["done"]) // G * G].reshape(-1, G).all(axis=1)


# A resumed row's carried tokens get their keys and values from one prefill over prompt + tokens, not from the
# one-token decode steps that computed them uninterrupted, and every row's steps run in batches of other widths: the
# same float32 sums reduced in other orders, so the log-probs differ by rounding alone (tests/tolerances.py): relative
# to their size, through at most 64 cache positions (prompt bucket 32 + new-token bucket 32), floor 1 nat (the
# logits' order). rtol = 2.2e-5; measured here: < 1e-6 relative. A wrong position, key or cache is 1e-1 and more.
LOGP_TOLS = f32_tols(decoder_terms(CFG, 64), floor=1.0)


def _assert_logprobs_close(got, ref):
    np.testing.assert_allclose(got, ref, **LOGP_TOLS)


def test_layout_keeps_each_shards_rows_on_its_own_sequences():
    key = jax.random.key(0)
    plain = rows.layout(PROMPTS[:3], 3, [4] * 9, (), 4, 32, 4, 0, key)  # no resumed rows: the prompts as before
    assert plain.sequences == PROMPTS[:3] + [PROMPTS[0]] and plain.real_rows == 9 and plain.groups == 3
    assert plain.carried == [[]] * 4
    np.testing.assert_array_equal(plain.rows.source_N, np.arange(12) // 3)
    np.testing.assert_array_equal(plain.limit_N, [4] * 9 + [0] * 3)  # filler rows: budget 0, done from the start
    back = [rows.Resumed([7, 8], [9, 10, 11], [-1.0, -2.0, -3.0], 5, 17, 8, "a"),
            rows.Resumed([7], [12], [-0.5], 6, 2, None, "a"), rows.Resumed([3], [], [], 5, 4)]
    mixed = rows.layout(PROMPTS[:3], 3, [4] * 9, back, 4, 32, 4, 0, key)
    N, B = len(mixed.limit_N), len(mixed.sequences)
    assert (N, mixed.real_rows, mixed.groups) == (12, 12, 5) and B % 4 == 0
    assert decode_pool.queue_groups(N, B, 8, 4) == 4
    # the program runs the resumed rows first (they take the slots first); the output is fresh rows, then resumed
    np.testing.assert_array_equal(mixed.output, [3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 1, 2])
    wanted = [([7, 8], [9, 10, 11]), ([7], [12]), ([3], [])] + [(PROMPTS[n // 3], []) for n in range(9)]
    for n in range(12):  # each shard's rows continue sequences of its own block
        assert mixed.rows.source_N[n] // (B // 4) == n // (N // 4)
        source = mixed.rows.source_N[n]
        assert (mixed.sequences[source], mixed.carried[source]) == wanted[n]
    # a block: its resumed rows' sequences (padded to carrying, one power of two for all shards), then its prompts;
    # only the first part is prefilled over the carried positions
    assert plain.carrying == 0 and mixed.carrying == 4 and B == 4 * (4 + 1)
    for n in range(12):
        assert (mixed.rows.source_N[n] % (B // 4) < mixed.carrying) == (n < 3)
    np.testing.assert_array_equal(mixed.rows.start_N[:3], [3, 1, 0])
    np.testing.assert_array_equal(mixed.rows.id_N, [17, 2, 4] + list(range(9)))
    np.testing.assert_array_equal(mixed.rows.group_N, [3, 3, 4] + [0] * 3 + [1] * 3 + [2] * 3)
    np.testing.assert_array_equal(mixed.limit_N[:3], [8, 4, 4])
    np.testing.assert_array_equal(mixed.tokens_NxC[0, :4], [9, 10, 11, 0])
    np.testing.assert_array_equal(mixed.logp_NxC[0, :4], [-1.0, -2.0, -3.0, 0.0])
    data = lambda s: np.asarray(jax.random.key_data(jax.random.key(s)))
    np.testing.assert_array_equal(mixed.rows.key_N[[3, 0, 1, 2]], [data(0), data(5), data(6), data(5)])


def test_default_unchanged(params):
    """No resumed rows and stop_after_groups None, or as many groups as the call has (the loop ends when every row
    stopped either way): today's outputs, bit for bit, every row done."""
    kw = dict(max_new_tokens=24, num_samples=G, seed=7, eos_ids=(3,), row_max_new_tokens=LIMITS, slots=4, **SAMPLING)
    ref = _np(sampler.generate(CFG, params, PROMPTS, **kw))
    for extra in (dict(stop_after_groups=None, resume=()), dict(stop_after_groups=len(PROMPTS))):
        got = _np(sampler.generate(CFG, params, PROMPTS, **kw, **extra))
        for k in ref:
            np.testing.assert_array_equal(got[k], ref[k], err_msg=k)
    assert ref["done"].all()


@pytest.mark.parametrize("slots", [None, 4])
def test_early_stop_returns_complete_groups_as_uninterrupted(params, slots):
    kw = dict(max_new_tokens=24, num_samples=G, seed=3, eos_ids=(), row_max_new_tokens=LIMITS, slots=slots, **SAMPLING)
    full = _np(sampler.generate(CFG, params, PROMPTS, **kw))
    for k in (1, 2, 3):
        got = _np(sampler.generate(CFG, params, PROMPTS, stop_after_groups=k, **kw))
        complete = _groups_done(got, G)
        assert complete.sum() >= k and got["steps"] < full["steps"]
        if slots is None:  # one static batch: a row of n tokens stops at step n, so group g at its longest row's
            assert got["steps"] == sorted(np.reshape(LIMITS, (-1, G)).max(axis=1))[k - 1]
        done = got["done"]
        np.testing.assert_array_equal(got["lengths"][done], LIMITS_ARR[done])
        for key in ("tokens", "logprobs", "lengths", "finished", "prompt_tokens"):  # the same steps, bit for bit
            np.testing.assert_array_equal(got[key][done], full[key][done], err_msg=key)
        cut = ~done  # the others: their tokens and log-probs so far, unfinished
        assert cut.any() and not got["finished"][cut].any() and (got["lengths"][cut] < LIMITS_ARR[cut]).all()
        for n in np.flatnonzero(cut):
            m = got["lengths"][n]
            np.testing.assert_array_equal(got["tokens"][n, :m], full["tokens"][n, :m])
            np.testing.assert_array_equal(got["logprobs"][n, :m], full["logprobs"][n, :m])
            assert (got["tokens"][n, m:] == CFG.pad_token_id).all() and (got["logprobs"][n, m:] == 0).all()



def _check_resumed(got, ref, carried, first):
    """Rows first.. of `got` are `carried` resumed: equal to `ref`'s rows of the same ids (tokens bit for bit, the
    carried log-probs exactly as given, the new ones within _assert_logprobs_close), prompts their own."""
    for i, r in enumerate(carried):
        n, j0 = first + i, len(r.tokens)
        assert got["done"][n] and got["lengths"][n] == ref["lengths"][r.row_id]
        np.testing.assert_array_equal(got["tokens"][n], ref["tokens"][r.row_id])
        assert got["finished"][n] == ref["finished"][r.row_id]
        np.testing.assert_array_equal(got["logprobs"][n, :j0], np.asarray(r.logprobs, np.float32))
        _assert_logprobs_close(got["logprobs"][n], ref["logprobs"][r.row_id])
        assert got["prompt_tokens"][n][got["prompt_mask"][n]].tolist() == list(r.prompt)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_resumed_rows_continue_as_if_never_interrupted(params, temperature):
    """The weights do not change: interrupt a call (stop_after_groups), resume its running rows together with fresh
    prompts, interrupt that call too and resume again: each row equals its uninterrupted generation for the same
    key, and the fresh prompts' rows equal a call of their own."""
    kw = dict(max_new_tokens=24, eos_ids=(), temperature=temperature, top_p=0.95)
    first = dict(num_samples=G, seed=7, row_max_new_tokens=LIMITS)
    free = _np(sampler.generate(CFG, params, PROMPTS, **first, **kw))
    kw["eos_ids"] = (int(free["tokens"][0, 15]),) if temperature else ()  # sampled rows may also stop at an EOS
    ref = _np(sampler.generate(CFG, params, PROMPTS, **first, **kw))
    out = sampler.generate(CFG, params, PROMPTS, stop_after_groups=2, slots=4, **first, **kw)
    carried = rows.interrupted(out, PROMPTS, 7, G, LIMITS)
    assert len(carried) >= 2 and all(len(r.tokens) for r in carried)

    alone = _np(sampler.generate(CFG, params, FRESH, num_samples=2, seed=11, **kw))
    mixed = sampler.generate(CFG, params, FRESH, num_samples=2, seed=11, resume=carried, slots=5, **kw)
    got = _np(mixed)
    np.testing.assert_array_equal(got["tokens"][:4], alone["tokens"])
    _assert_logprobs_close(got["logprobs"][:4], alone["logprobs"])  # prefilled in a batch of another size
    _check_resumed(got, ref, carried, 4)

    # again, with a row of each kind interrupted the second time: carried rows keep their groups (all-done groups
    # of the first call's carried rows count as complete)
    mixed = sampler.generate(CFG, params, FRESH, num_samples=2, seed=11, resume=carried, slots=2,
                             stop_after_groups=1, **kw)
    again = rows.interrupted(mixed, FRESH, 11, 2, resume=carried)
    assert {r.key for r in again} == {7, 11}, "a fresh row and a carried row both interrupted"
    last = _np(sampler.generate(CFG, params, [[9]], seed=0, resume=again, **kw))
    for i, r in enumerate(again):  # rows the first call started, then rows the second started
        _check_resumed(last, ref if r.key == 7 else alone, [r], 1 + i)


def test_changed_weights_record_the_drawing_policys_logprobs(params):
    """The weights change between the calls: a resumed row's carried log-probs are the old policy's (which drew
    those tokens), its new ones the new policy's, whose prefill recomputes the carried tokens' cache."""
    T = 0.8
    kw = dict(max_new_tokens=24, eos_ids=(), temperature=T)
    out = sampler.generate(CFG, params, PROMPTS, num_samples=G, seed=4, row_max_new_tokens=LIMITS,
                           stop_after_groups=1, **kw)
    carried = rows.interrupted(out, PROMPTS, 4, G, LIMITS)
    noise = _random_params(CFG, seed=9, std=0.05)
    moved = jax.tree.map(lambda a, b: a + b, params, noise)
    got = sampler.generate(CFG, moved, FRESH, num_samples=2, seed=2, resume=carried, **kw)
    new, recorded = _recomputed_logprobs(CFG, moved, got, T)
    old, _ = _recomputed_logprobs(CFG, params, got, T)
    starts = np.array([0] * 4 + [len(r.tokens) for r in carried])
    carried_mask = np.arange(recorded.shape[1])[None] < starts[:, None]
    # against the full forward: the KV-cache steps' sums in another order (LOGP_TOLS)
    np.testing.assert_allclose(np.where(carried_mask, recorded, 0), np.where(carried_mask, old, 0), **LOGP_TOLS)
    np.testing.assert_allclose(np.where(carried_mask, 0, recorded), np.where(carried_mask, 0, new), **LOGP_TOLS)
    assert np.abs(old - new).max() > 1e-2  # the two policies are told apart
    assert np.asarray(got.done).all()


def test_resume_sharded_on_8_devices(params):
    if jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices")
    mesh = sharding.make_mesh((2, 2, 2))  # rows over data x fsdp = 4, KV heads over 2
    kw = dict(max_new_tokens=24, eos_ids=(), num_samples=G, row_max_new_tokens=LIMITS, **SAMPLING)
    ref = _np(sampler.generate(CFG, params, PROMPTS, seed=5, **kw))  # one device, uninterrupted
    out = sampler.generate(CFG, params, PROMPTS, seed=5, stop_after_groups=2, slots=8, mesh=mesh, **kw)
    assert out.tokens.sharding.mesh.size == 8
    carried = rows.interrupted(out, PROMPTS, 5, G, LIMITS)
    alone = _np(sampler.generate(CFG, params, FRESH, num_samples=3, seed=1, max_new_tokens=24, eos_ids=(),
                                 **SAMPLING))
    got = _np(sampler.generate(CFG, params, FRESH, num_samples=3, seed=1, max_new_tokens=24, eos_ids=(),
                               resume=carried, slots=8, mesh=mesh, **SAMPLING))
    np.testing.assert_array_equal(got["tokens"][:6], alone["tokens"])
    _assert_logprobs_close(got["logprobs"][:6], alone["logprobs"])
    _check_resumed(got, ref, carried, 6)


@pytest.mark.parametrize("resumed, kw, match", [
    (rows.Resumed([1], [2, 3], [-1.0], 0, 0), {}, "2 tokens and 1 log-probs"),
    (rows.Resumed([1], [2, 3], [-1.0, -1.0], 0, 0, 2), {}, "tokens so far < its max_new_tokens"),
    (rows.Resumed([1], [2, 3], [-1.0, -1.0], 0, 0), {"eos_ids": (3,)}, "ends in a stop token"),
    (rows.Resumed([], [2], [-1.0], 0, 0), {}, "needs a prompt"),
    (rows.Resumed([1], [2], [-1.0], 0, 0), {"stop_after_groups": 3}, "stop_after_groups=3"),
])
def test_bad_resumed_rows_name_the_fix(params, resumed, kw, match):
    with pytest.raises(ValueError, match=match):
        sampler.generate(CFG, params, [[1, 2]], **{"max_new_tokens": 4, "resume": [resumed], **kw})


def test_resumed_rows_continue_in_the_tpu_program(params):
    """The carried rows of partial rollouts in the TPU's decode program (run on the CPU, its kernel interpreted):
    resumed beside fresh prompts, each row equals its uninterrupted generation."""
    tpu = decode_forms.emulated("tpu")
    kw = dict(max_new_tokens=24, eos_ids=(), temperature=0.9, top_p=0.95, decode_attention=tpu)
    first = dict(num_samples=G, seed=7, row_max_new_tokens=LIMITS)
    ref = _np(sampler.generate(CFG, params, PROMPTS, **first, **kw))
    out = sampler.generate(CFG, params, PROMPTS, stop_after_groups=2, slots=4, **first, **kw)
    carried = rows.interrupted(out, PROMPTS, 7, G, LIMITS)
    assert len(carried) >= 2 and all(len(r.tokens) for r in carried)
    got = _np(sampler.generate(CFG, params, FRESH, num_samples=2, seed=11, resume=carried, slots=5, **kw))
    _check_resumed(got, ref, carried, 4)
