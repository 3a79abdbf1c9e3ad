"""The decode pool kept on the device across calls (sampling/session.py): without pauses it is sampler.generate;
a paused row keeps its cache and draws on as if never paused; tokens appended to a paused row are fed, never drawn,
and the row goes on as generate's resume of the same tokens would."""

import jax
import numpy as np
import pytest

from sage_jax.models import decoder as model_lib
from sage_jax.sampling import sampler
from sage_jax.sampling.rows import Resumed
from sage_jax.sampling.session import PoolSession

CFG = model_lib.ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                            intermediate_size=64, rope_theta=10000.0, max_position_embeddings=256)
PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11], [12], [13, 14, 15, 16, 17, 18, 19, 21, 22, 23, 24, 25, 26, 27, 28, 29]]
PAUSE = 20
KW = dict(temperature=1.0, eos_ids=(2,), num_samples=2)


@pytest.fixture(scope="module")
def params():
    return model_lib.init_params(CFG, jax.random.key(0))


def _run(session, on_pause):
    """Drives a session to its end; on_pause(session, n) decides for each row that paused."""
    while True:
        ran = session.advance()
        for n in session.newly_stopped():
            if session.paused[n] and not session.done[n]:
                on_pause(session, n)
        if not ran and not session.decoding():
            return session.result()


@pytest.mark.parametrize("slots", [None, 3])
def test_session_without_pauses_equals_generate(params, slots):
    """Calls of 3 steps (across the pool's shrinking widths; with 3 slots, rows queue) give generate's rows."""
    key = jax.random.key(3)
    ref = jax.device_get(sampler.generate(CFG, params, PROMPTS, 40, seed=key, slots=slots, **KW))
    s = PoolSession(CFG, params, PROMPTS, 40, pause_ids=(), steps_per_call=3, seed=key, slots=slots, **KW)
    got = _run(s, None)
    assert s.calls > 40 / 3
    for f in ("tokens", "lengths", "finished", "logprobs", "prompt_tokens", "prompt_mask", "done"):
        np.testing.assert_array_equal(getattr(got, f), np.asarray(getattr(ref, f)), err_msg=f)


@pytest.mark.parametrize("hold", [1, 6])
def test_a_paused_row_keeps_its_cache_and_draws_as_if_never_paused(params, hold):
    """Rows pause at PAUSE and are released `hold` to hold + 2 calls later (others decode meanwhile): every token
    and log-prob equals generate's. Held longer, paused rows wait past the width the calls compute (moved there with
    their cache rows), and come back into it (the pool widening again) when released."""
    key = jax.random.key(5)
    ref = jax.device_get(sampler.generate(CFG, params, PROMPTS, 48, seed=key, **KW))
    assert np.sum(np.asarray(ref.tokens) == PAUSE) >= 3  # the case pauses rows
    held, parked, widened = {}, 0, 0
    s = PoolSession(CFG, params, PROMPTS, 48, pause_ids=(PAUSE,), steps_per_call=2, seed=key, **KW)
    while True:
        width = s.plan.stages[s.level]
        ran = s.advance()
        parked += int(np.sum(~s.done & (s.group >= 0))) > s.plan.stages[s.level]  # more rows than slots computed
        widened += s.plan.stages[s.level] > width
        for n in s.newly_stopped():
            if s.paused[n] and not s.done[n]:
                held[n] = hold + n % 3
        for n in list(held):
            held[n] -= 1
            if not held[n]:
                s.release(n)
                del held[n]
        if not ran and not s.decoding() and not held:
            break
    got = s.result()
    np.testing.assert_array_equal(got.tokens, np.asarray(ref.tokens))
    np.testing.assert_array_equal(got.logprobs, np.asarray(ref.logprobs))
    np.testing.assert_array_equal(got.lengths, np.asarray(ref.lengths))
    if hold > 1:
        assert parked >= 3 and widened >= 1, (parked, widened)


def test_appended_tokens_are_fed_and_the_row_goes_on_as_generates_resume(params):
    """At its first pause a row gets 3 tokens appended: they sit after its pause token with NaN log-probs, and its
    later tokens are those generate draws for the row resumed with the same tokens carried in."""
    key, extra = jax.random.key(7), [2, 30, 31]  # an EOS id among them is fed, never a stop
    appended = {}

    def on_pause(s, n):
        if n in appended or s.lengths[n] + len(extra) >= 48:
            s.release(n)
        else:
            appended[n] = int(s.lengths[n])
            s.append(n, extra)
    s = PoolSession(CFG, params, PROMPTS, 48, pause_ids=(PAUSE,), steps_per_call=4, seed=key, **KW)
    got = _run(s, on_pause)
    assert len(appended) >= 2
    for n, at in appended.items():
        toks = got.tokens[n, :got.lengths[n]]
        assert list(toks[at:at + 3]) == extra and toks[at - 1] == PAUSE
        assert np.isnan(got.logprobs[n, at:at + 3]).all() and np.isfinite(got.logprobs[n, :at]).all()
        back = Resumed(PROMPTS[n // 2], list(toks[:at + 3]), [0.0] * (at + 3), key, n, 48)
        ref = jax.device_get(sampler.generate(CFG, params, [[1]], 48, temperature=1.0, eos_ids=(2,), seed=key,
                                              resume=[back], row_max_new_tokens=[1]))
        L = int(ref.lengths[1])
        np.testing.assert_array_equal(np.asarray(ref.tokens)[1, at + 3:L], toks[at + 3:L])
        np.testing.assert_allclose(np.asarray(ref.logprobs)[1, at + 3:L], got.logprobs[n, at + 3:L], atol=1e-5)


def test_end_stops_a_row_and_bad_appends_are_refused(params):
    s = PoolSession(CFG, params, PROMPTS, 48, pause_ids=(PAUSE,), steps_per_call=4, seed=jax.random.key(5), **KW)
    ended = []

    def on_pause(s, n):
        with pytest.raises(ValueError, match="no room"):
            s.append(n, [1] * 48)
        ended.append((n, int(s.lengths[n])))
        s.end(n)
    got = _run(s, on_pause)
    assert ended
    for n, length in ended:
        assert got.lengths[n] == length and got.done[n] and not got.finished[n]
    running = [n for n in range(len(got.lengths)) if not got.done[n]]
    assert not running
    with pytest.raises(ValueError, match="not paused"):
        s.append(0, [1])


def test_a_session_on_a_mesh_equals_generate(params):
    """On a (data 2, fsdp 2, tensor 2) mesh of simulated CPU devices, rows paused and released: generate's rows."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    from sage_jax.models import sharding
    key, mesh = jax.random.key(5), sharding.make_mesh((2, 2, 2))
    ref = jax.device_get(sampler.generate(CFG, params, PROMPTS, 40, seed=key, mesh=mesh, **KW))
    s = PoolSession(CFG, params, PROMPTS, 40, pause_ids=(PAUSE,), steps_per_call=3, seed=key, mesh=mesh, **KW)
    got = _run(s, lambda s, n: s.release(n))
    np.testing.assert_array_equal(got.tokens, np.asarray(ref.tokens))
    np.testing.assert_array_equal(got.logprobs, np.asarray(ref.logprobs))
