import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax.models import decode_forms, kv_cache, decoder as model, sharding
from sage_jax.sampling import sampler
from tests.tolerances import decoder_terms, f32_tols

CFG = model.ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                        intermediate_size=64, rope_theta=10000.0)
# Log-probs of CFG computed along other reduction orders (a batch of another width, a KV-cache step against the full
# forward, sharded against one device): float32 rounding relative to their size (tests/tolerances.py), through at
# most 144 cache positions; the floor is 1 nat, the order of the logits behind a log-prob near 0. rtol = 2.6e-5,
# 1.3e-4 at -4 (measured here: 1.1e-5); every log-prob read one position late fails it (by up to 3.7), as does one
# off by 1e-3.
LOGP_TOLS = f32_tols(decoder_terms(CFG, 144), floor=1.0)
PROMPTS = [[5, 9, 13], [7, 1, 2, 3, 4, 8, 11], [21], [33, 34, 35, 36, 37]]


def _random_params(cfg, seed=0, std=0.3):
    """numpy init (no compile): wide weights so greedy argmax is never a near tie."""
    rng = np.random.default_rng(seed)

    def leaf(path, shape):
        x = rng.normal(0.0, std, shape)
        return jnp.asarray(1.0 + x if "norm" in jax.tree_util.keystr(path) else x, jnp.float32)
    return jax.tree_util.tree_map_with_path(leaf, model.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))


@pytest.fixture(scope="module")
def params():
    return _random_params(CFG)


def _np(out):
    return {k: np.asarray(v) for k, v in out._asdict().items()}


def test_greedy_matches_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    from sage_jax.models import hf_io
    from tests.helpers_hf import tiny_hf_model
    import transformers

    path = tiny_hf_model(tmp_path / "hf", initializer_range=0.3, vocab=96)
    cfg, params = hf_io.load_hf(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [[5, 9, 13, 40], [7, 1, 4, 8, 11, 60, 61, 62, 70], [21], [33, 34, 35, 36, 37, 38]]
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=32, eos_token_id=[2, 3],
                          pad_token_id=0)[:, width:].numpy()
    ref = np.pad(ref, ((0, 0), (0, 32 - ref.shape[1])))
    out = _np(sampler.generate(cfg, params, prompts, max_new_tokens=32, temperature=0.0, eos_ids=(2, 3), pad_id=0))
    np.testing.assert_array_equal(out["tokens"], ref)
    stopped = np.isin(ref, [2, 3]).any(-1)
    np.testing.assert_array_equal(out["finished"], stopped)


def _recomputed_logprobs(cfg, params, out, temperature):
    o = _np(out)
    C = o["tokens"].shape[1]
    comp_mask = np.arange(C)[None] < o["lengths"][:, None]
    tokens = np.concatenate([o["prompt_tokens"], o["tokens"]], axis=1)
    mask = np.concatenate([o["prompt_mask"], comp_mask], axis=1)
    logits = jax.jit(model.forward, static_argnums=0)(cfg, params, jnp.asarray(tokens), mask_BxT=jnp.asarray(mask))
    P = o["prompt_tokens"].shape[1]
    logp_all = jax.nn.log_softmax(logits[:, P - 1:-1] / temperature, axis=-1)
    logp = np.take_along_axis(np.asarray(logp_all), o["tokens"][..., None], axis=-1)[..., 0]
    return np.where(comp_mask, logp, 0.0), o["logprobs"]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_full_forward(params, temperature):
    out = sampler.generate(CFG, params, PROMPTS, max_new_tokens=12, temperature=temperature, top_k=10, top_p=0.9,
                           eos_ids=(3,), seed=1)
    expected, got = _recomputed_logprobs(CFG, params, out, temperature)
    np.testing.assert_allclose(got, expected, **LOGP_TOLS)


def test_greedy_logprobs_are_untempered(params):
    out = sampler.generate(CFG, params, PROMPTS, max_new_tokens=8, temperature=0.0, eos_ids=())
    expected, got = _recomputed_logprobs(CFG, params, out, 1.0)
    np.testing.assert_allclose(got, expected, **LOGP_TOLS)


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sample_frequencies_match_softmax(top_p):
    stats = pytest.importorskip("scipy.stats")
    logits_V = jnp.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n, T = 20000, 0.8
    sample = jax.jit(sampler.sample_tokens, static_argnames="greedy")
    toks, _ = sample(jnp.broadcast_to(logits_V, (n, 6)), jax.random.key(3), jnp.arange(n), greedy=False,
                     temperature=T, top_p=None if top_p == 1.0 else top_p)
    counts = np.bincount(np.asarray(toks), minlength=6)
    probs = np.exp(np.asarray(logits_V, np.float64) / T)
    probs /= probs.sum()
    kept = (np.cumsum(probs) - probs) < top_p
    assert (counts[~kept] == 0).all()
    expected = n * probs[kept] / probs[kept].sum()
    assert stats.chisquare(counts[kept], expected).pvalue > 1e-3


def test_nucleus_search_matches_sorting():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (16, 300)).astype(np.float32)
    logits[:4, :40] = logits[:4, :1]  # ties
    top_p = rng.uniform(0.05, 0.99, 16).astype(np.float32)
    filt = jax.jit(sampler.filter_logits)
    for b in range(16):
        got = np.isfinite(np.asarray(filt(logits[b:b + 1], top_p=top_p[b])))[0]
        order = np.argsort(-logits[b], kind="stable")
        p = np.exp(logits[b][order] - logits[b].max())
        p /= p.sum()
        count = max(int(np.sum(np.cumsum(p) - p < top_p[b])), 1)
        expected = logits[b] >= logits[b][order][count - 1]
        np.testing.assert_array_equal(got, expected)


def test_rows_and_steps_use_distinct_keys():
    logits = jnp.zeros((2, 1000))
    sample = jax.jit(sampler.sample_tokens, static_argnames="greedy")
    a, _ = sample(logits, jax.random.key(0), jnp.arange(2), greedy=False)
    b, _ = sample(logits, jax.random.fold_in(jax.random.key(0), 1), jnp.arange(2), greedy=False)
    assert a[0] != a[1] and (a != b).any()


def test_inverse_cdf_never_picks_a_removed_token():
    # A float32 cumsum over a Qwen-sized vocabulary is not monotone on XLA:CPU, so removed entries can get a small
    # non-zero cdf step; uniforms aimed at exactly those steps must still land on kept tokens.
    V = 152064
    logits = 4.0 * jax.random.normal(jax.random.key(0), (8, V))
    filtered = np.asarray(jax.jit(lambda x: sampler.filter_logits(x, min_p=0.01))(logits))
    cdf = np.asarray(jax.jit(lambda x: jnp.cumsum(jnp.exp(x - x.max(-1, keepdims=True)), -1))(filtered))
    removed = ~np.isfinite(filtered)
    rows, cols = np.nonzero(removed[:, 1:] & (np.diff(cdf, axis=-1) > 0))
    cols = cols + 1
    assert len(rows) > 0  # the uneven steps this test aims at exist
    aimed = (0.5 * (cdf[rows, cols - 1] + cdf[rows, cols]) / cdf[rows, -1]).astype(np.float32)
    random_rows = np.repeat(np.arange(8), 64)
    uniform = np.concatenate([aimed, np.random.default_rng(0).uniform(size=len(random_rows)).astype(np.float32),
                              np.ones(8, np.float32)])  # u = 1 rounds u * total up to total
    all_rows = np.concatenate([rows, random_rows, np.arange(8)])
    picks = np.asarray(jax.jit(sampler._inverse_cdf)(jnp.asarray(filtered[all_rows]), jnp.asarray(uniform)))
    assert not removed[all_rows, picks].any()


def test_two_level_inverse_cdf_matches_a_flat_float64_search():
    """Block sums, then the cdf within the block: the same token as searching one float64 cdf of the whole
    vocabulary (V = 1000 is not a multiple of the block, and a third of the entries are removed)."""
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 3, (32, 1000)).astype(np.float32)
    logits[rng.uniform(size=logits.shape) < 0.3] = -np.inf
    uniform = rng.uniform(size=32).astype(np.float32)
    picks = np.asarray(jax.jit(sampler._inverse_cdf)(jnp.asarray(logits), jnp.asarray(uniform)))
    p = np.exp(logits.astype(np.float64) - logits.max(-1, keepdims=True))
    cdf = np.cumsum(p, -1)
    expected = np.argmax(cdf > uniform[:, None] * cdf[:, -1:], axis=-1)
    np.testing.assert_array_equal(picks, expected)


def test_filters_on_crafted_distribution():
    probs = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = jnp.log(jnp.asarray(probs))[None]
    filt = jax.jit(sampler.filter_logits, static_argnames="top_k")
    kept = lambda **kw: np.isfinite(np.asarray(filt(logits, **kw)))[0].tolist()
    assert kept(top_k=2) == [True, True, False, False, False]
    assert kept(top_p=0.7) == [True, True, False, False, False]  # 0.4 + 0.3 reaches 0.7
    assert kept(top_p=0.71) == [True, True, True, False, False]
    assert kept(top_p=0.01) == [True, False, False, False, False]
    assert kept(min_p=0.3) == [True, True, True, False, False]  # p >= 0.12
    assert kept(top_k=3, top_p=0.5) == [True, True, False, False, False]  # nucleus within renormalised top-3
    assert kept(top_k=4, min_p=0.5) == [True, True, False, False, False]
    assert all(kept())


@pytest.mark.parametrize("top_k", [0, 3])
def test_filters_never_sort_the_vocabulary(top_k):
    hlo = jax.jit(sampler.filter_logits, static_argnames="top_k").lower(
        jnp.zeros((2, 64)), top_k=top_k, top_p=0.9, min_p=0.1).compile().as_text()
    assert " sort(" not in hlo


def test_eos_stops_rows_and_pads(params):
    free = _np(sampler.generate(CFG, params, PROMPTS, max_new_tokens=10, temperature=0.0, eos_ids=()))
    eos = (int(free["tokens"][0, 3]), int(free["tokens"][2, 5]))
    out = _np(sampler.generate(CFG, params, PROMPTS, max_new_tokens=10, temperature=0.0, eos_ids=eos, pad_id=63))
    for b in range(len(PROMPTS)):
        hits = np.flatnonzero(np.isin(free["tokens"][b], eos))
        n = hits[0] + 1 if len(hits) else 10
        assert out["lengths"][b] == n and out["finished"][b] == bool(len(hits))
        np.testing.assert_array_equal(out["tokens"][b, :n], free["tokens"][b, :n])
        assert (out["tokens"][b, n:] == 63).all() and (out["logprobs"][b, n:] == 0).all()
    assert out["lengths"][0] <= 4 and out["lengths"][2] <= 6
    assert out["steps"] == (out["lengths"].max() if out["finished"].all() else 10)


def test_loop_exits_when_every_row_stopped(params):
    free = _np(sampler.generate(CFG, params, PROMPTS, max_new_tokens=10, temperature=0.0, eos_ids=()))
    out = _np(sampler.generate(CFG, params, PROMPTS, max_new_tokens=10, temperature=0.0,
                               eos_ids=tuple(set(free["tokens"][:, 1].tolist()))))
    assert out["finished"].all() and (out["lengths"] <= 2).all()
    assert out["steps"] == out["lengths"].max()


def test_groups(params):
    G = 3
    greedy = _np(sampler.generate(CFG, params, PROMPTS, max_new_tokens=6, temperature=0.0, num_samples=G))
    single = _np(sampler.generate(CFG, params, PROMPTS, max_new_tokens=6, temperature=0.0))
    np.testing.assert_array_equal(greedy["tokens"], np.repeat(single["tokens"], G, axis=0))
    np.testing.assert_array_equal(greedy["prompt_tokens"], np.repeat(single["prompt_tokens"], G, axis=0))
    hot = _np(sampler.generate(CFG, params, PROMPTS, max_new_tokens=6, temperature=1.0, num_samples=G, seed=7))
    assert hot["tokens"].shape == (len(PROMPTS) * G, 6)
    assert len({tuple(r) for r in hot["tokens"]}) == len(hot["tokens"])


def test_sharded_greedy_equals_single_device(params):
    if jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices")
    prompts = PROMPTS[:3]  # 3 prompts x 2 samples: padded to 4 x 2 rows, a multiple of data x fsdp = 4
    ref = _np(sampler.generate(CFG, params, PROMPTS, max_new_tokens=8, temperature=0.0))
    mesh = sharding.make_mesh((2, 2, 2))
    sharded = model.shard_params(params, mesh, cfg=CFG)
    for out in (sampler.generate(CFG, sharded, prompts, max_new_tokens=8, temperature=0.0, num_samples=2),
                sampler.generate(CFG, params, prompts, max_new_tokens=8, temperature=0.0, num_samples=2, mesh=mesh)):
        assert out.tokens.sharding.mesh.size == 8
        got = _np(out)
        np.testing.assert_array_equal(got["tokens"], np.repeat(ref["tokens"][:3], 2, axis=0))
        np.testing.assert_allclose(got["logprobs"], np.repeat(ref["logprobs"][:3], 2, axis=0), **LOGP_TOLS)
    # 3 prompts x 4 samples: 12 rows over data x fsdp = 4, rows stopping at their budgets, in 4 and in 12 slots
    limits = [8, 1, 2, 3, 5, 1, 1, 2, 7, 4, 1, 2]
    expected = np.where(np.arange(8)[None] < np.array(limits)[:, None], np.repeat(ref["tokens"][:3], 4, axis=0),
                        CFG.pad_token_id)
    for slots in (None, 4):
        got = _np(sampler.generate(CFG, sharded, prompts, max_new_tokens=8, temperature=0.0, num_samples=4,
                                   row_max_new_tokens=limits, slots=slots))
        np.testing.assert_array_equal(got["tokens"], expected)
        np.testing.assert_array_equal(got["lengths"], limits)


def test_one_compile_per_bucket(params):
    before = sampler.compile_count()
    for seed, prompts in enumerate([[[1, 2, 3], [4, 5]], [[6] * 9, [7, 8, 9, 10]], [[11] * 14, [12]]] * 3):
        new = 10 + 5 * (seed % 3)
        limits = [1 + (seed * 7 + r * 5) % new for r in range(2)]
        sampler.generate(CFG, params, prompts, max_new_tokens=new, temperature=1.0, seed=seed,
                         row_max_new_tokens=None if seed % 2 else limits, eos_ids=(seed % 5 + 1,))
    assert sampler.compile_count() - before == 1
    for seed, prompts in enumerate([[[1, 2, 3], [4, 5]], [[6] * 9, [7, 8, 9, 10]]] * 2):
        # slots=2 is the default for 2 rows (the same program); slots=1 is one more (S, P, C) bucket
        sampler.generate(CFG, params, prompts, max_new_tokens=10 + seed, temperature=1.0, seed=seed,
                         slots=1 + seed % 2)
    assert sampler.compile_count() - before == 2


def _longtail_case(params, slots=(1, 3, 8, 20), **kw):
    """4 prompts x 4 samples = 16 rows, budgets 1..70 new tokens: the cache (16 prompt + 128 new slots) spans three
    64-slot attention blocks, the last one shifted back to fit. -> (static batch, {slots: outputs}, limits)."""
    limits = [70, 1, 5, 33, 2, 64, 9, 3, 17, 1, 40, 6, 12, 2, 25, 4]
    run = lambda s: _np(sampler.generate(CFG, params, PROMPTS, max_new_tokens=70, num_samples=4,
                                         row_max_new_tokens=limits, slots=s, **kw))
    return run(None), {s: run(s) for s in slots}, np.array(limits)


def _assert_same_outputs(a, b, steps=True):
    for key in ("tokens", "lengths", "finished", "prompt_tokens", "prompt_mask") + (("steps",) if steps else ()):
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    # a row's logits come from batches of other sizes and other shards: XLA:CPU's matmuls round differently, and
    # differently on another CPU (tokens do not move); 1.48e-5 at -4 on one AMD EPYC failed the old atol=1e-5
    np.testing.assert_allclose(a["logprobs"], b["logprobs"], **LOGP_TOLS)


def test_slot_pool_equals_static_batch_greedy_with_forced_lengths(params):
    static, pooled, limits = _longtail_case(params, temperature=0.0, eos_ids=())
    np.testing.assert_array_equal(static["lengths"], limits)
    assert not static["finished"].any() and static["steps"] == 70
    for s, got in pooled.items():  # S = 1, 3, N/2 and more slots than rows
        _assert_same_outputs(got, static, steps=s >= 16)
    # S = 1 decodes one row at a time: one step per token after each row's first
    assert pooled[1]["steps"] == 1 + int(np.sum(limits - 1))
    longest = _np(sampler.generate(CFG, params, PROMPTS, max_new_tokens=70, temperature=0.0, eos_ids=()))
    for b, n in enumerate(limits):  # each row: the first n tokens of its prompt's greedy completion, then padding
        np.testing.assert_array_equal(static["tokens"][b, :n], longest["tokens"][b // 4, :n])
        assert (static["tokens"][b, n:] == CFG.pad_token_id).all() and (static["logprobs"][b, n:] == 0).all()


@pytest.mark.parametrize("kw", [dict(top_p=0.9), dict(top_k=5, min_p=0.05, temperature=0.7)])
def test_slot_pool_equals_static_batch_with_eos_and_sampling(params, kw):
    kw = {"temperature": 1.0, **kw}
    free = _np(sampler.generate(CFG, params, PROMPTS, max_new_tokens=70, seed=3, eos_ids=(), num_samples=4, **kw))
    eos = (int(free["tokens"][0, 20]), int(free["tokens"][5, 2]))
    static, pooled, limits = _longtail_case(params, seed=3, eos_ids=eos, **kw)
    for s, got in pooled.items():
        _assert_same_outputs(got, static, steps=s >= 16)
    stopped = static["finished"]
    assert stopped.any() and (static["lengths"] <= limits).all()
    last = static["tokens"][np.arange(16), static["lengths"] - 1]
    assert np.isin(last[stopped], eos).all()
    assert (static["lengths"][~stopped] == limits[~stopped]).all()


def test_stage_widths():
    from sage_jax.sampling.decode_pool import stage_widths
    # four widths per halving (steps of a quarter of the power of two below), steps of 2 the finest, down to 2
    assert stage_widths(64, 1) == (64, 56, 48, 40, 32, 28, 24, 20, 16, 14, 12, 10, 8, 6, 4, 2)
    assert stage_widths(20, 1) == (20, 16, 14, 12, 10, 8, 6, 4, 2) and stage_widths(8, 1) == (8, 6, 4, 2)
    assert stage_widths(16, 4) == (16, 8)  # counted per data x fsdp shard: 4, 2 slots each
    assert stage_widths(48, 8) == (48, 32, 16) and stage_widths(64, 16) == (64, 32)
    assert stage_widths(256, 1)[-1] == 8  # and never below S/32
    assert stage_widths(12, 4) == (12,) and stage_widths(3, 1) == (3,) and stage_widths(5, 1) == (5, 3)
    assert stage_widths(1, 1) == (1,) and stage_widths(64, 24) == (64,)  # slots that do not split over the shards
    # short completions: halves only (a width is a loop body to compile, paid back over long completions)
    assert stage_widths(64, 1, 127) == (64, 32, 16, 8, 4, 2) and stage_widths(64, 1, 128) == stage_widths(64, 1)
    assert stage_widths(256, 1, 24) == (256, 128, 64, 32, 16, 8) and stage_widths(16, 4, 24) == (16, 8)


def test_shrink_stages_equal_one_static_batch(params, monkeypatch):
    """The pool shrinks to 14, 12, ... 2 slots (16 rows, one device) and to 8 (4-way data parallel, 8 devices) once
    its queue is empty; the tokens equal a static batch that never shrinks, on one device and sharded."""
    from sage_jax.sampling import decode_pool, prefill
    real = decode_pool.stage_widths
    monkeypatch.setattr(decode_pool, "stage_widths", lambda s, dp, c: (s,))
    flat, _, limits = _longtail_case(params, slots=(), temperature=0.0, eos_ids=())
    monkeypatch.setattr(decode_pool, "stage_widths", real)
    monkeypatch.setattr(prefill, "FINE_WIDTHS_MIN_TOKENS", 0)  # the fine widths, at this test's short lengths
    assert real(16, 1, 8) == (16, 14, 12, 10, 8, 6, 4, 2)
    staged, pooled, _ = _longtail_case(params, slots=(3, 8), temperature=0.0, eos_ids=())
    for got in (staged, *pooled.values()):
        _assert_same_outputs(got, flat, steps=got is staged)
    if jax.device_count() >= 8:
        mesh = sharding.make_mesh((2, 2, 2))
        assert real(16, 4) == (16, 8)
        static, sharded, _ = _longtail_case(params, slots=(8,), temperature=0.0, eos_ids=(), mesh=mesh)
        _assert_same_outputs(static, flat)
        _assert_same_outputs(sharded[8], flat, steps=False)


def test_slot_pool_filler_rows_and_first_token_stops(params):
    """3 prompts x 3 samples with rows stopping at their first token (limit 1): the queue skips them; on a 4-way
    data-parallel mesh the 9 rows are padded with filler rows that never take a slot."""
    limits = [1, 7, 1, 1, 12, 3, 1, 9, 2]
    run = lambda s, **kw: _np(sampler.generate(CFG, params, PROMPTS[:3], max_new_tokens=12, num_samples=3, seed=5,
                                               row_max_new_tokens=limits, slots=s, **kw))
    static = run(None)
    np.testing.assert_array_equal(static["lengths"], limits)
    for s in (1, 2, 5):
        _assert_same_outputs(run(s), static, steps=False)
    if jax.device_count() >= 8:
        mesh = sharding.make_mesh((2, 2, 2))
        for s in (None, 4):
            got = run(s, mesh=mesh)
            _assert_same_outputs(got, static, steps=False)


def test_blocked_decode_attention_matches_softmax_and_skips_unwritten_blocks():
    rng = np.random.default_rng(0)
    B, N, K, H, S = 3, 4, 2, 8, 300  # S is not a multiple of the block: the last block is shifted back
    q = jnp.asarray(rng.normal(size=(B, 1, N, H)), jnp.float32)
    k, v = (rng.normal(size=(B, K, S, H)).astype(np.float32) for _ in range(2))
    allowed = np.zeros((B, 1, S), bool)
    for b, (first, end) in enumerate([(0, 70), (10, 130), (40, 129)]):  # left padding, then written slots
        allowed[b, 0, first:end] = True
    k[:, :, 192:], v[:, :, 192:] = np.nan, np.nan  # blocks past the last written slot must not be read
    got = np.asarray(kv_cache.cached_attention(q, jnp.asarray(k), jnp.asarray(v), jnp.asarray(allowed)))
    assert S > model.DECODE_BLOCK and np.isfinite(got).all()
    qg = np.asarray(q).reshape(B, K, N // K, H)
    scores = np.einsum("bkgh,bksh->bkgs", qg, np.nan_to_num(k)) / np.sqrt(H)
    scores = np.where(allowed[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    expected = np.einsum("bkgs,bksh->bkgh", probs, np.nan_to_num(v)).reshape(B, 1, N, H)
    # scores over H, softmax and weighted sum over S slots, blockwise vs at once; outputs near 0 are averages of v ~ 1
    np.testing.assert_allclose(got, expected, **f32_tols(H + 2 * S, floor=1.0))


def test_bench_sampler_smoke():
    pytest.importorskip("torch")
    from sage_jax.bench import sampler as bench
    rows = bench.bench_sampler(presets=("tiny",), dtype="fp32", batch=4, prompt_len=8, new_tokens=8, repeats=1,
                               latency=False)
    by = {r["impl"]: r for r in rows}
    assert [r["impl"] for r in rows] == ["sage_jax", "transformers", bench.MATMULS_ONLY, bench.ATTENTION_ONLY,
                                         bench.MATMULS_ATTENTION]
    assert all(r["tokens_per_s"] > 0 and r.get("gflops_per_s", 1) > 0 for r in rows)
    matmuls, attention, both = by[bench.MATMULS_ONLY], by[bench.ATTENTION_ONLY], by[bench.MATMULS_ATTENTION]
    assert matmuls["frac_of_peak"] == pytest.approx(1.0)  # the matmuls-only row is the peak
    assert rows[0]["frac_of_peak"] == pytest.approx(rows[0]["gflops_per_s"] / matmuls["gflops_per_s"])
    assert both["seconds"] == pytest.approx(matmuls["seconds"] + attention["seconds"])
    assert both["frac_of_peak"] < 1.0 and "frac_of_peak" not in attention
    assert rows[0]["frac_of_matmuls_attention"] == pytest.approx(rows[0]["frac_of_peak"] / both["frac_of_peak"])


def test_decode_attention_floor_reads_what_the_sampler_reads(params, monkeypatch):
    """attention_only runs kv_cache.cached_attention once per layer on the sampler's cache shape (traced: shapes
    only)."""
    from sage_jax.bench import sampler as bench
    seen = []
    real = kv_cache.cached_attention

    def spy(q, k, v, allowed):
        seen.append((k.shape, allowed.shape))
        return real(q, k, v, allowed)
    monkeypatch.setattr(kv_cache, "cached_attention", spy)
    out = jax.block_until_ready(bench.decode_attention_fn(CFG, rows=3, prompt_len=8, steps=8)())
    S = sampler.prompt_bucket(8) + sampler.new_tokens_bucket(8)
    assert seen and all(k == (3, CFG.num_kv_heads, S, CFG.head_dim) and a == (3, 1, S) for k, a in seen)
    assert len(seen) == CFG.num_layers and np.all(np.isfinite(np.asarray(out)))


def test_decode_matmuls_flops_match_xla_count(params):
    """The matmuls-only ceiling counts exactly the matmuls XLA runs (one decode step: XLA counts a loop body once)."""
    from sage_jax.bench import sampler as bench
    fn, flops = bench.decode_matmuls_fn(CFG, params, rows=3, steps=1)
    cost = jax.jit(fn).lower().cost_analysis()  # before optimisation: compiling would fold the constant weights
    xla = (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]
    assert 0.9 < flops / xla <= 1.0  # XLA also counts the norms and element-wise work


def test_decode_flops_counts_prefill_once_per_prompt():
    from sage_jax.bench import flops as bench_flops
    cfg = model.preset("tiny")
    D, V = cfg.hidden_size, cfg.vocab_size
    prefill = bench_flops.decode_flops(cfg, prompts=2, samples=8, prompt_len=16, new_tokens=1)
    assert prefill == bench_flops.decode_flops(cfg, prompts=2, samples=1, prompt_len=16, new_tokens=1)
    per_step = bench_flops.decode_flops(cfg, 2, 8, 16, 3) - bench_flops.decode_flops(cfg, 2, 8, 16, 2)
    layer_params = cfg.num_params - V * D - D  # tied embeddings
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * (16 + 32)  # prompt bucket + new-token bucket
    assert per_step == 16 * (2 * layer_params + 2 * D * V + attention)


@pytest.mark.parametrize("prompts, kw, match", [
    ([[]], {}, "at least one token"),
    ([[1, 64]], {}, "token ids must lie"),
    ([[1]], {"top_p": 0.0}, "bad sampling settings"),
    ([[1]], {"max_new_tokens": 40000}, "max_position_embeddings"),
    ([[1]], {"slots": 0}, "slots=0 must be an integer >= 1"),
])
def test_bad_arguments_name_the_fix(params, prompts, kw, match):
    with pytest.raises(ValueError, match=match):
        sampler.generate(CFG, params, prompts, **{"max_new_tokens": 4, **kw})


def test_one_kv_cache_in_memory(params, monkeypatch):
    """XLA:CPU's temporaries of the whole program (prefill + decode loop) on 8 simulated devices, long completions
    (C = 1024 new-token bucket vs 16 prompt positions): the slot cache, once, plus what is small beside it here (the
    prompt caches, the first tokens' logits, one step's activations). The bound 2x the cache shard leaves room for
    layout copies; the compacting loop this replaced held 4.1x (it gathered the live rows of the data-sharded cache
    into each smaller batch), with S = N/4 slots too."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices")
    real, seen = sampler.generate_program, {}

    def spy(cfg, plan, *args):
        seen["temp"], seen["slots"] = real.lower(cfg, plan, *args).compile().memory_analysis().temp_size_in_bytes, \
            plan.slots
        return real(cfg, plan, *args)
    monkeypatch.setattr(sampler, "generate_program", spy)
    mesh = sharding.make_mesh((4, 1, 2))  # rows over 4, the 2 KV heads over 2: a cache shard is 1/8 of the cache
    for slots in (None, 4):
        sampler.generate(CFG, params, PROMPTS, max_new_tokens=1000, num_samples=4, eos_ids=(), mesh=mesh,
                         row_max_new_tokens=[1] * 16, slots=slots)
        shard = 2 * CFG.num_layers * seen["slots"] * CFG.num_kv_heads * (16 + 1024) * CFG.head_dim * 4 // 8
        assert seen["temp"] < 2 * shard, (slots, seen["temp"] / shard)


def test_decode_holds_one_layers_gathered_weights(monkeypatch):
    """Weights sharded over fsdp on 8 simulated devices, stacked (the layout XLA:TPU and the plan compile): the
    prefill and every decode step loop over the layers, so the program holds one layer's all-gathered weights at a
    time and its temporaries grow per layer by the layer's cache, not by its gathered weights. Unrolled, XLA:CPU
    gathered every layer's weights at the start of each step: 1.16 gathered layers more per layer here, 5.7 GB per
    device for qwen7b_branch on 64 devices."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices")
    real, temps = sampler.generate_program, {}

    def spy(cfg, plan, *args):
        temps[cfg.num_layers] = real.lower(cfg, plan, *args).compile().memory_analysis().temp_size_in_bytes
        return real(cfg, plan, *args)
    monkeypatch.setattr(sampler, "generate_program", spy)
    mesh = sharding.make_mesh((1, 8, 1))
    for layers in (2, 6):
        cfg = CFG.replace(hidden_size=64, num_layers=layers, head_dim=16, intermediate_size=512)
        p = model.shard_params(model.init_params(cfg, jax.random.key(0)), mesh, cfg=cfg)
        sampler.generate(cfg, p, [[1, 2, 3]] * 8, max_new_tokens=8, num_samples=2, eos_ids=(), mesh=mesh,
                         unstack_layers=False)
    gathered_layer = 4 * (3 * 64 * 512 + 4 * 64 * 4 * 16)  # float32 bytes of one layer's matmul weights
    assert (temps[6] - temps[2]) / 4 < 0.5 * gathered_layer, temps


def test_greedy_compiles_as_cheaply_as_sampling(monkeypatch):
    """rollout.temperature=0 on the countdown vocabulary (23 tokens, configs/tiny_test.py's model): jnp.argmax's
    variadic reduce kept XLA:CPU's LLVM loop vectorizer busy for minutes (issue 27); the greedy program must compile
    in about the time of the sampling one, measured in the same run (a ratio)."""
    import time
    cfg = model.ModelConfig(vocab_size=23, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                            intermediate_size=128, qkv_bias=True, eos_token_ids=())
    params = _random_params(cfg)
    real, seconds = sampler.generate_program, {}

    def spy(cfg, plan, *args):
        t0 = time.perf_counter()
        real.lower(cfg, plan, *args).compile()
        seconds.setdefault(plan.greedy, time.perf_counter() - t0)  # the first compile (later ones hit JAX's cache)
        return real(cfg, plan, *args)
    monkeypatch.setattr(sampler, "generate_program", spy)
    for temperature in (1.0, 0.0):
        sampler.generate(cfg, params, [[3, 4, 5] * 6] * 4, max_new_tokens=16, temperature=temperature, num_samples=4)
    assert seconds[True] < 2.5 * seconds[False], seconds  # it was > 60x


@pytest.mark.parametrize("value, ok", [(None, True), ("auto", True), ("all", True), (32, True), ("16", True),
                                       (0, False), ("-4", False), ("many", False), (True, False)])
def test_rollout_slots_validation(value, ok):
    from sage_jax.run import config as config_lib
    c = config_lib.load("configs/tiny_test.py", [])
    with c.ignore_type():
        c.rollout.slots = value
    if ok:
        config_lib.validate(c)
    else:
        with pytest.raises(config_lib.ConfigError, match="rollout.slots"):
            config_lib.validate(c)


def test_auto_slots_is_every_row_without_a_memory_limit():
    assert jax.local_devices()[0].memory_stats() is None or "bytes_limit" not in jax.local_devices()[0].memory_stats()
    assert sampler.auto_slots(CFG, rows=16, prompts=4, cache_len=144, prompt_len=16, mesh=None) == 16


def test_bits_cache_decodes_exactly_like_a_bf16_cache():
    """model.BITS (the slot pool's cache): a bf16 model's k / v kept as uint16 bits, written per row and read by the
    blocked decode attention, gives the bf16 cache's hidden states and cache bits exactly (bitcasts are exact)."""
    cfg = CFG.replace(compute_dtype="bfloat16")
    p = _random_params(cfg, seed=3)
    B, S = 3, 2 * model.DECODE_BLOCK + 5  # > one block: the blocked attention's path
    step = jax.jit(lambda c, tok, idx: model.forward_with_cache(cfg, p, tok[:, None], idx[:, None], c, idx,
                                                                jnp.ones((B, S), bool), return_hidden=True))
    prefill = jax.jit(lambda c, tok: model.forward_with_cache(cfg, p, tok, jnp.broadcast_to(jnp.arange(4), (B, 4)),
                                                             c, 0, jnp.ones((B, S), bool), return_hidden=True))
    tok_Bx4 = jnp.asarray([[1, 2, 3, 4], [9, 8, 7, 6], [40, 41, 42, 43]], jnp.int32)
    hidden, caches = {}, {}
    for dt in (None, model.BITS):  # the prompt written at [0, 4) with one index (the prefill's path), then decode
        hidden[dt], caches[dt] = prefill(model.init_cache(cfg, B, S, dt), tok_Bx4)
    np.testing.assert_array_equal(np.asarray(hidden[None], np.float32), np.asarray(hidden[model.BITS], np.float32))
    for i in range(6):
        idx = jnp.asarray([4 + i, 2 * i + 5, S - 6 + i], jnp.int32)
        tok = jnp.asarray([5 + i, 9, 60 - i], jnp.int32)
        for dt in caches:
            hidden[dt], caches[dt] = step(caches[dt], tok, idx)
        assert caches[model.BITS][0][0].dtype == model.BITS
        np.testing.assert_array_equal(np.asarray(hidden[None], np.float32), np.asarray(hidden[model.BITS], np.float32))
    for (k, v), (kb, vb) in zip(caches[None], caches[model.BITS]):
        np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(k, jnp.uint16)), np.asarray(kb))
        np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(v, jnp.uint16)), np.asarray(vb))
    assert np.abs(np.asarray(kb)).sum() > 0  # something was written


@pytest.mark.parametrize("variant", ["plain", "bias_qknorm_untied", "lora"])
def test_rollout_weights_in_the_compute_dtype_sample_the_same_bits(variant, monkeypatch):
    """generate casts float32 weights to a bf16 compute dtype once (model.compute_params) instead of at every use
    inside the decode loop: the same tokens and log-probs, bit for bit, as the float32 weights give; the program
    gets bf16 weights; leaves that do not narrow are the caller's own arrays (a LoRA base is not copied)."""
    from sage_jax.models import lora
    cfg = CFG.replace(compute_dtype="bfloat16")
    if variant == "bias_qknorm_untied":
        cfg = cfg.replace(qkv_bias=True, qk_norm=True, tie_embeddings=False)
    p = _random_params(cfg, seed=5)
    if variant == "lora":
        lcfg = lora.LoraConfig(rank=4, alpha=8.0)
        adapters = jax.tree.map(lambda a: a + 0.05, lora.init_adapters(cfg, lcfg, jax.random.key(1)))
        base = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)  # a bf16 base, as LoRA's frozen reference is
        p = lora.apply(base, adapters, lcfg)
    cast = model.compute_params(cfg, p)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(cast))
    if variant == "lora":  # only the float32 adapters were cast: the base's arrays are passed through
        assert cast["embed"] is p["embed"] and cast["layers"]["wq"] is p["layers"]["wq"]
    assert model.compute_params(CFG, p) is p  # float32 compute: nothing to cast, no copy
    kw = dict(max_new_tokens=24, temperature=0.9, top_p=0.9, num_samples=3, seed=7, eos_ids=(3,))
    new = _np(sampler.generate(cfg, p, PROMPTS, **kw))
    monkeypatch.setattr(model, "compute_params", lambda cfg, params: params)
    old = _np(sampler.generate(cfg, p, PROMPTS, **kw))
    for k in new:
        np.testing.assert_array_equal(new[k], old[k], err_msg=k)
    assert new["lengths"].min() < 24 or not new["finished"].any()


def test_each_shard_queues_its_own_rows(params, monkeypatch):
    """On a data-parallel mesh each shard's slots take only its own rows (decode_pool.queue_groups), so a refill
    copies a prompt's cache on its own device; the tokens equal one global queue's. (The memory this saves shows at
    scale, not in a model this small: with one global queue XLA:CPU kept every prompt's cache on every device through
    the loop, 1.88 GB per device for qwen7b_branch on 64 devices; docs/PERFORMANCE.md, session 9.)"""
    from sage_jax.sampling import decode_pool
    if jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices")
    assert decode_pool.queue_groups(32, 16, 8, 4) == 4
    assert decode_pool.queue_groups(12, 3, 4, 4) == 1 and decode_pool.queue_groups(16, 4, 8, 1) == 1  # uneven; 1 dp
    real, groups = decode_pool.queue_groups, []
    monkeypatch.setattr(decode_pool, "queue_groups", lambda *a: groups.append(real(*a)) or groups[-1])
    mesh = sharding.make_mesh((1, 4, 2))  # rows over fsdp = 4, the 2 KV heads over 2
    prompts = [[1 + (7 * i + j) % 60 for j in range(20 + i)] for i in range(8)]
    limits = [1 + (13 * r) % 32 for r in range(32)]
    run = lambda **kw: _np(sampler.generate(CFG, params, prompts, max_new_tokens=32, num_samples=4, eos_ids=(),
                                            seed=3, row_max_new_tokens=limits, slots=8, **kw))
    one_device = run()
    per_shard = run(mesh=mesh)
    monkeypatch.setattr(decode_pool, "queue_groups", lambda *a: groups.append(1) or 1)
    sampler.generate_program.clear_cache()  # trace again: the same static arguments
    one_queue = run(mesh=mesh)
    sampler.generate_program.clear_cache()
    assert groups == [1, 4, 1]
    for got in (per_shard, one_queue):
        _assert_same_outputs(got, one_device, steps=False)
    np.testing.assert_array_equal(per_shard["lengths"], limits)


FORMS = {"tpu": decode_forms.emulated("tpu"), "gpu": decode_forms.emulated("gpu"),
         "tpu-one-pass": decode_forms.emulated("tpu", "one_pass")}


@pytest.mark.parametrize("forms", [f if f != "tpu-one-pass" else pytest.param(f, marks=pytest.mark.slow)
                                   for f in FORMS])
def test_each_platforms_decode_program_samples_what_the_cpus_does(params, forms):
    """The TPU and GPU programs (matmul scores, a cache pair per layer with the layers unrolled, the Pallas kernel
    reading each row's live slots, no shrinking widths; the GPU's several steps per loop iteration), run on the CPU
    with the kernels interpreted: the same tokens as XLA:CPU's program with left-padded prompts of other lengths,
    rows refilled into freed slots mid-call (3 slots for 16 rows) and sampling, the log-probs within rounding."""
    static, _, limits = _longtail_case(params, slots=(), seed=3, temperature=1.0, top_p=0.9, eos_ids=())
    run = lambda: _np(sampler.generate(CFG, params, PROMPTS, max_new_tokens=70, num_samples=4, seed=3,
                                       temperature=1.0, top_p=0.9, eos_ids=(), row_max_new_tokens=limits, slots=3,
                                       decode_attention=FORMS[forms]))
    _assert_same_outputs(run(), static, steps=False)


def test_gpu_program_waits_on_the_host_fewer_times_per_token(params):
    """SampleOutput.loops counts the data-dependent loop iterations and branches (on XLA:GPU a host round trip
    each): the GPU's forms run several decode steps per iteration."""
    kw = dict(max_new_tokens=40, num_samples=4, temperature=0.0, eos_ids=(), slots=8)
    cpu = sampler.generate(CFG, params, PROMPTS, **kw)
    gpu = sampler.generate(CFG, params, PROMPTS, decode_attention=decode_forms.emulated("gpu"), **kw)
    np.testing.assert_array_equal(np.asarray(gpu.tokens), np.asarray(cpu.tokens))
    assert int(cpu.steps) == int(gpu.steps) and int(gpu.loops) < int(cpu.loops) / 2


def test_sharded_tpu_program_equals_single_device(params):
    """The TPU's decode program on a mesh: each device runs the kernel on its own rows and KV heads (Pallas kernels
    are not partitioned by XLA), the rows refilled within their shards: the tokens of one device's CPU program."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices")
    prompts, limits = PROMPTS[:3], [8, 1, 2, 3, 5, 1, 1, 2, 7, 4, 1, 2]
    kw = dict(max_new_tokens=8, temperature=0.0, num_samples=4, row_max_new_tokens=limits)
    ref = _np(sampler.generate(CFG, params, prompts, **kw))
    sharded = model.shard_params(params, sharding.make_mesh((2, 2, 2)), cfg=CFG)
    got = _np(sampler.generate(CFG, sharded, prompts, slots=4, decode_attention=decode_forms.emulated("tpu"), **kw))
    np.testing.assert_array_equal(got["tokens"], ref["tokens"])
    np.testing.assert_allclose(got["logprobs"], ref["logprobs"], **LOGP_TOLS)
