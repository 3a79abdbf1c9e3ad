import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from sage_jax.rl import guides


def _cfg(**kw) -> guides.GuideConfig:
    return guides.GuideConfig(**kw)


# one compiled program per call shape instead of one per eager op
compute_q = jax.jit(guides.compute_q, static_argnums=(0, 5))
normalize = jax.jit(guides.normalize_per_sequence, static_argnums=(2, 3))


# --------------------------------------------------------------------------------------------------- schedule

def test_schedule_start_end_and_cycle_boundaries():
    start, end, total, cycles, decay = 0.3, 0.1, 800, 8, 0.9
    steps = np.array([0, 50, 99.999, 100, 700, total, 10 * total] + list(range(100, 200)), np.float32)
    values = np.asarray(guides.cosine_cycle_schedule(start, end, steps, total, cycles, decay))
    expected = [start, (start + end) / 2,  # start, half way through cycle 0
                end, start * decay,  # each cycle ends at `end` and restarts from a decayed upper bound
                start * decay ** 7, end, end]
    np.testing.assert_allclose(values[:7], expected, atol=1e-6)
    assert np.all(np.diff(values[7:]) <= 0)  # monotone within a cycle
    # the Token guide's alpha (0.3 -> 0.1, 1000 steps) at step 500, the start of cycle 4: 0.3 * 0.9**4
    alpha = guides.cosine_cycle_schedule(0.3, 0.1, 500, 1000, 8, 0.9)
    assert float(alpha) == pytest.approx(0.19683, abs=1e-5)


def test_schedule_traced_step_under_jit():
    f = jax.jit(lambda s: guides.cosine_cycle_schedule(0.1, 0.0, s, 1000, 8, 0.9))
    assert float(f(jnp.int32(0))) == pytest.approx(0.1)
    assert float(f(jnp.int32(1000))) == pytest.approx(0.0, abs=1e-7)


# --------------------------------------------------------------------------------------------------- branch

def test_branch_q_at_known_entropies_with_clamp_and_padding():
    entropy = jnp.array([[0.0, 1.2, 2.2, 10.0, 3.0]])
    mask = jnp.array([[1, 1, 1, 1, 0]])
    cfg = _cfg(name="branch", gamma=0.3, tau=1.2)
    q = compute_q("branch", jnp.zeros_like(entropy), entropy, mask, None, cfg)
    np.testing.assert_allclose(q, [[1.0, 1.0, 1.3, 1.4, 1.0]], atol=1e-6)  # 10 clamps at q_max; padding is 1
    log_q = guides.compute_log_q("branch", jnp.zeros_like(entropy), entropy, mask, None, cfg)
    np.testing.assert_allclose(log_q, np.log([[1.0, 1.0, 1.3, 1.4, 1.0]]), atol=1e-6)
    assert float(log_q[0, 4]) == 0.0


def test_guides_carry_no_gradient():
    entropy = jnp.array([[2.0, 3.0]])
    logp = jnp.array([[-1.0, -2.0]])
    mask = jnp.ones((1, 2))

    def total_log_q(lp, h):
        return sum(guides.compute_log_q(name, lp, h, mask, jax.random.PRNGKey(0), _cfg(name=name)).sum()
                   for name in guides.GUIDES)

    g_logp, g_ent = jax.jit(jax.grad(total_log_q, argnums=(0, 1)))(logp, entropy)
    assert not np.any(np.asarray(g_logp)) and not np.any(np.asarray(g_ent))


def test_none_guide_is_exactly_one():
    x = jnp.ones((2, 3))
    log_q = guides.compute_log_q("none", -x, x, x, None, _cfg())
    assert np.array_equal(np.asarray(log_q), np.zeros((2, 3)))


# --------------------------------------------------------------------------------------------------- token

def test_minmax_normalisation_clips_at_quantiles():
    s = jnp.arange(21.0)[None]  # quantile 5% of 0..20 is 1.0, 95% is 19.0
    mask = jnp.ones_like(s)
    w = normalize(s, mask, "minmax", (0.05, 0.95))
    np.testing.assert_allclose(w[0], np.clip((np.arange(21.0) - 1.0) / 18.0, 0, 1), atol=1e-6)


def test_minmax_ignores_padding_and_handles_flat_rows():
    s = jnp.array([[0.0, 1.0, 2.0, 100.0], [5.0, 5.0, 5.0, 5.0], [1.0, 2.0, 3.0, 4.0]])
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    w = normalize(s, mask, "minmax", (0.0, 1.0))
    np.testing.assert_allclose(w, [[0.0, 0.5, 1.0, 0.0], [0, 0, 0, 0], [0, 0, 0, 0]], atol=1e-6)
    assert np.isfinite(np.asarray(w)).all()


def test_rank_normalisation_averages_ties():
    s = jnp.array([[3.0, 1.0, 2.0, 2.0, 9.0]])
    mask = jnp.array([[1, 1, 1, 1, 0]])
    w = normalize(s, mask, "rank")
    np.testing.assert_allclose(w, [[1.0, 0.0, 0.5, 0.5, 0.0]], atol=1e-6)


def test_zsigmoid_normalisation():
    x = np.array([1.0, 2.0, 6.0])
    s = jnp.array([[1.0, 2.0, 6.0, -50.0]])
    w = normalize(s, jnp.array([[1, 1, 1, 0]]), "zsigmoid")
    expected = 1.0 / (1.0 + np.exp(-(x - x.mean()) / (x.std() + 1e-6)))
    np.testing.assert_allclose(w[0, :3], expected, atol=1e-5)
    assert float(w[0, 3]) == 0.0


def test_token_guide_uses_surprisal_and_schedule():
    logp = -jnp.array([[0.0, 1.0, 2.0, 7.0]])  # surprisal 0, 1, 2 (+ padding)
    mask = jnp.array([[1, 1, 1, 0]])
    cfg = _cfg(name="token", token_norm="minmax", token_quantiles=(0.0, 1.0), token_alpha=0.3, token_alpha_end=0.1,
               token_sigma=0.0, token_sigma_end=0.0, schedule_steps=80)
    q0 = compute_q("token", logp, jnp.zeros_like(logp), mask, jax.random.PRNGKey(0), cfg, step=0)
    np.testing.assert_allclose(q0, [[1.0, 1.15, 1.3, 1.0]], atol=1e-6)
    q_end = compute_q("token", logp, jnp.zeros_like(logp), mask, jax.random.PRNGKey(0), cfg, step=80)
    np.testing.assert_allclose(q_end, [[1.0, 1.05, 1.1, 1.0]], atol=1e-6)


def test_token_guide_noise_scales_with_w():
    n, c = 64, 128
    logp = -jnp.tile(jnp.arange(c, dtype=jnp.float32), (n, 1))
    cfg = _cfg(name="token", token_quantiles=(0.0, 1.0), token_alpha=0.0, token_alpha_end=0.0, token_sigma=0.2,
               token_sigma_end=0.2, q_min=0.01, q_max=10.0)
    q = np.asarray(compute_q("token", logp, logp, jnp.ones((n, c)), jax.random.PRNGKey(1), cfg))
    assert np.all(q[:, 0] == 1.0)  # w = 0: no noise at the least surprising token
    assert np.std(q[:, -1]) == pytest.approx(0.2, rel=0.25)  # w = 1: full sigma


# --------------------------------------------------------------------------------------------------- random

def test_random_guide_statistics_fixed_seed():
    n, c = 64, 256
    cfg = _cfg(name="random", random_eps=0.1, random_eps_end=0.1, random_std=0.15, random_std_end=0.15,
               q_min=0.01, q_max=10.0)
    zeros = jnp.zeros((n, c))
    q = np.asarray(compute_q("random", zeros, zeros, jnp.ones((n, c)), jax.random.PRNGKey(0), cfg))
    perturbed = q != 1.0
    assert perturbed.mean() == pytest.approx(0.1, abs=0.01)
    assert np.std(q[perturbed] - 1.0) == pytest.approx(0.15, abs=0.01)
    q2 = compute_q("random", zeros, zeros, jnp.ones((n, c)), jax.random.PRNGKey(1), cfg)
    assert not np.array_equal(q, np.asarray(q2))


def test_random_guide_clamps_and_anneals_to_off():
    n, c = 16, 64
    zeros, mask = jnp.zeros((n, c)), jnp.ones((n, c)).at[:, -8:].set(0)
    cfg = _cfg(name="random", random_eps=1.0, random_eps_end=0.0, random_std=1.0, random_std_end=1.0,
               schedule_steps=100)
    q = np.asarray(compute_q("random", zeros, zeros, mask, jax.random.PRNGKey(0), cfg, step=0))
    assert q.min() == pytest.approx(0.6) and q.max() == pytest.approx(1.4)
    assert np.all(q[:, -8:] == 1.0)
    q_end = compute_q("random", zeros, zeros, mask, jax.random.PRNGKey(0), cfg, step=100)
    assert np.all(np.asarray(q_end) == 1.0)


def test_random_guide_needs_a_key():
    with pytest.raises(ValueError, match="key"):
        compute_q("random", jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1, 2)), None, _cfg())


# --------------------------------------------------------------------------------------------------- stats, config

def test_q_stats():
    log_q = jnp.log(jnp.array([[1.0, 1.3, 0.8], [1.4, 5.0, 1.0]]))
    mask = jnp.array([[1, 1, 1], [1, 0, 0]])
    stats = guides.q_stats(log_q, mask)
    assert float(stats["sage/q_mean"]) == pytest.approx((1.0 + 1.3 + 0.8 + 1.4) / 4, abs=1e-6)
    assert float(stats["sage/q_min"]) == pytest.approx(0.8, abs=1e-6)
    assert float(stats["sage/q_max"]) == pytest.approx(1.4, abs=1e-6)
    assert float(stats["sage/q_frac_above_1"]) == pytest.approx(0.5)
    assert float(stats["sage/q_active"]) == pytest.approx(0.75)  # 1.3, 0.8, 1.4: q != 1 on either side
    # q over the 4 real tokens sorted 0.8, 1.0, 1.3, 1.4: position 0.9 * 3 = 2.7 -> 1.3 + 0.7 * 0.1
    assert float(stats["sage/q_p90"]) == pytest.approx(1.37, abs=1e-5)
    empty = guides.q_stats(log_q, jnp.zeros_like(mask))
    assert all(np.isfinite(float(v)) for v in empty.values())
    assert float(empty["sage/q_mean"]) == 1.0 and float(empty["sage/q_p90"]) == 1.0
    assert float(empty["sage/q_active"]) == 0.0


def test_guide_config_from_config_dict():
    loss = ml_collections.ConfigDict({"guide": "token", "gamma": 0.5, "token_quantiles": [0.1, 0.9],
                                      "kl_estimator": "k3"})
    cfg = guides.GuideConfig.from_config(loss, total_steps=200)
    assert cfg.name == "token" and cfg.gamma == 0.5 and cfg.token_quantiles == (0.1, 0.9)
    assert cfg.schedule_steps == 200 and cfg.q_min == 0.6
    hash(cfg)
    with pytest.raises(ValueError, match="guide"):
        guides.GuideConfig(name="entropy")
    with pytest.raises(ValueError, match="q_min"):
        guides.GuideConfig(q_min=1.2)


# --------------------------------------------------------------------------------------------------- noise keys

def test_guide_noise_is_fresh_for_every_micro_batch_mini_batch_and_iteration():
    import optax
    from sage_jax.training import state as train_state
    guide = guides.GuideConfig(name="random", random_eps=1.0, random_eps_end=1.0, random_std=0.1,
                               random_std_end=0.1)

    def loss_fn(params, batch, cfg, loss_cfg, step, key):  # d loss / d w[row] = that row's q
        w_NxC = params["w"][batch["row"]]
        q_NxC = guides.compute_q("random", w_NxC, w_NxC, jnp.ones_like(w_NxC), key, guide, step)
        return jnp.sum(w_NxC * q_NxC), {}

    n, c, accum = 8, 3, 4
    step = train_state.make_train_step(None, None, optax.sgd(1.0), lambda s: 1.0, seed=0, grad_accum=accum,
                                   loss_fn=loss_fn)
    batch = {"row": jnp.arange(n), "rl_step": jnp.int32(5)}
    state = {"step": jnp.int32(0), "params": {"w": jnp.zeros((n, c))}, "opt_state": optax.sgd(1.0).init(None)}
    q_per_update = []
    for _ in range(2):  # two updates within one RL step: two mini-batches, or two iterations over one
        before = np.asarray(state["params"]["w"])
        state, _ = step(state, batch)
        q_per_update.append((before - np.asarray(state["params"]["w"])) * accum)
    q = q_per_update[0]
    assert np.all(q != 1.0)  # every token perturbed
    # micro-batch m holds rows m, m + accum: rows 0..accum-1 sit at the same place in different micro-batches
    assert len({tuple(q[m]) for m in range(accum)}) == accum
    assert not np.allclose(q_per_update[0], q_per_update[1])
