import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from sage_jax.rl import guides
from sage_jax.models import decoder as model_lib
from sage_jax.rl import objectives as obj

sg = jax.lax.stop_gradient
# one compiled program per call shape instead of one per eager op (keeps the file fast on a busy CPU)
loss_from_logprobs = jax.jit(obj.loss_from_logprobs, static_argnums=(3,))
kl_term = jax.jit(obj.kl_term, static_argnums=(3,))


# --------------------------------------------------------------------------------------------------- advantages

def test_group_advantages_hand_values():
    r = jnp.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = np.asarray(obj.group_advantages(r, 4))
    std = np.sqrt(0.1875)
    np.testing.assert_allclose(adv[:4], np.array([0.75, -0.25, -0.25, -0.25]) / (std + 1e-6), rtol=1e-6)
    assert np.array_equal(adv[4:], np.zeros(4))  # zero-variance group: exactly 0
    adv1 = np.asarray(obj.group_advantages(r, 4, ddof=1))
    np.testing.assert_allclose(adv1[:4], np.array([0.75, -0.25, -0.25, -0.25]) / (np.sqrt(0.25) + 1e-6), rtol=1e-6)
    np.testing.assert_allclose(obj.group_advantages(r, 4, scale="none")[:4], [0.75, -0.25, -0.25, -0.25])
    batch_std = np.std(np.asarray(r))
    np.testing.assert_allclose(obj.group_advantages(r, 4, scale="batch")[:4],
                               np.array([0.75, -0.25, -0.25, -0.25]) / (batch_std + 1e-6), rtol=1e-6)
    np.testing.assert_allclose(obj.group_advantages(r, 4, scale="none", estimator="rloo")[:4],
                               [1.0, -1 / 3, -1 / 3, -1 / 3], rtol=1e-6)


def test_zero_variance_groups_never_nan():
    r = jnp.array([0.1] * 8 + [0.3, 0.7, 0.3, 0.7, 2.0, 2.0, 2.0, 2.0])
    assert np.array_equal(np.asarray(obj.zero_variance_groups(r, 4)), [True, True, False, True])
    for scale in obj.ADV_SCALES:
        for estimator in obj.ADV_ESTIMATORS:
            adv = np.asarray(obj.group_advantages(r, 4, scale=scale, estimator=estimator, ddof=1))
            assert np.isfinite(adv).all()
            assert np.array_equal(adv[:8], np.zeros(8)) and np.array_equal(adv[12:], np.zeros(4))
    single = obj.group_advantages(jnp.array([1.0, 0.0]), 1, ddof=1)
    assert np.array_equal(np.asarray(single), [0.0, 0.0])


def test_paper_configs_normalise_advantages_like_the_reference_trainer():
    from sage_jax.run import config as config_lib
    from sage_jax.training import trainer
    loss_cfg = trainer.loss_config(config_lib.load("configs/qwen7b_grpo.py", []))
    r = jnp.array([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    adv = obj.group_advantages(r, 8, scale=loss_cfg.adv_scale, eps=loss_cfg.adv_eps, ddof=loss_cfg.std_ddof)
    r = np.asarray(r)
    np.testing.assert_allclose(adv, (r - r.mean()) / (r.std(ddof=1) + 1e-4), rtol=1e-6)  # torch.std, eps 1e-4


def test_arm_configs_say_what_each_arm_is():
    import importlib
    bnpo, dapo = (" ".join(importlib.import_module(f"configs.qwen7b_{name}").__doc__.split())
                  for name in ("bnpo", "dapo"))
    assert 'loss_type="bnpo"' in bnpo and "not the BNPO paper's Beta-normalised advantages" in bnpo
    for part in ("clip-higher", "dynamic sampling", "overlong", "only the loss type"):
        assert part in dapo, part


def test_kl_arms_differ_from_grpo_only_in_their_anchor():
    from sage_jax.run import config as config_lib
    from sage_jax.training import trainer
    arm = lambda name: dataclasses.asdict(trainer.loss_config(config_lib.load(f"configs/qwen7b_{name}.py", [])))
    grpo = arm("grpo")
    changed = lambda name: {k: v for k, v in arm(name).items() if grpo[k] != v}
    assert changed("fkl") == {"kl_estimator": "forward-seq"}
    assert changed("grpo_rkl") == {"kl_estimator": "k1", "kl_in_reward": True}


def test_group_advantages_bad_shapes():
    with pytest.raises(ValueError, match="groups of 3"):
        obj.group_advantages(jnp.zeros(8), 3)
    with pytest.raises(ValueError, match="rloo"):
        obj.group_advantages(jnp.zeros(4), 1, estimator="rloo")
    with pytest.raises(ValueError, match="adv_scale"):
        obj.group_advantages(jnp.zeros(4), 2, scale="std")


# --------------------------------------------------------------------------------------------------- kl_term

def test_kl_term_values_and_gradients():
    logp = jnp.array([-1.0, -2.0, -0.5])
    ref = jnp.array([-1.5, -1.0, -0.5])
    log_q = jnp.log(jnp.array([1.2, 0.8, 1.0]))
    d = np.asarray(ref + log_q - logp)
    expected = {"k1": -d, "k2": 0.5 * d ** 2, "k3": np.exp(d) - d - 1, "k3+": np.exp(d) - d - 1,
                "forward": np.exp(d) * d - np.exp(d) + 1, "none": np.zeros(3)}
    grads = {"k1": np.ones(3), "k2": -d, "k3": 1 - np.exp(d), "k3+": -d, "forward": -np.exp(d),
             "none": np.zeros(3)}
    for est in obj.KL_ESTIMATORS:
        np.testing.assert_allclose(kl_term(logp, ref, log_q, est), expected[est], rtol=1e-5, atol=1e-6)
        g, g_ref = jax.jit(jax.grad(lambda lp, rl: obj.kl_term(lp, rl, log_q, est).sum(), argnums=(0, 1)))(logp, ref)
        np.testing.assert_allclose(g, grads[est], rtol=1e-5, atol=1e-6, err_msg=est)
        assert not np.any(np.asarray(g_ref))
    k3 = kl_term(logp, ref, log_q, "k3")
    assert np.array_equal(np.asarray(kl_term(logp, ref, log_q, "k3+")), np.asarray(k3))  # exactly k3's value


def test_kl_term_masked_entries_are_zero_and_finite():
    logp = jnp.array([-1.0, -200.0])
    ref = jnp.array([-1.0, 0.0])
    mask = jnp.array([1.0, 0.0])
    for est in obj.KL_ESTIMATORS:
        value, g = jax.value_and_grad(lambda lp: obj.kl_term(lp, ref, None, est, mask).sum())(logp)
        assert np.isfinite(float(value)) and np.isfinite(np.asarray(g)).all()
        assert float(g[1]) == 0.0
    with pytest.raises(ValueError, match="kl_estimator"):
        obj.kl_term(logp, ref, None, "k4")


def test_kl_term_keeps_its_pull_where_the_policy_is_far_from_the_anchor():
    # d = log m - log pi = -30: the policy sits far above the anchor; k3's gradient 1 - e^d ~ 1 must pull it back.
    # d = +30: far below; the exponent is capped there, but the gradient must keep pulling log pi up.
    logp = jnp.array([-0.01, -31.0])
    ref = jnp.array([-30.01, -1.0])
    d = np.asarray(ref - logp, np.float64)
    grad = lambda est: np.asarray(jax.grad(lambda lp: obj.kl_term(lp, ref, None, est).sum())(logp))
    np.testing.assert_allclose(grad("k3")[0], 1.0 - np.exp(d[0]), rtol=1e-6)
    np.testing.assert_allclose(grad("forward")[0], -np.exp(d[0]), rtol=1e-4)
    for est in ("k3", "forward"):
        assert grad(est)[1] == pytest.approx(-np.exp(obj.LOG_RATIO_CLIP), rel=1e-3), est
        assert np.isfinite(np.asarray(kl_term(logp, ref, None, est))).all()
    np.testing.assert_allclose(kl_term(logp, ref, None, "k3")[0], np.exp(d[0]) - d[0] - 1.0, rtol=1e-6)


def test_kl_reward_penalty():
    logp = jnp.array([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    ref = jnp.array([[-1.5, -1.0, 0.0], [0.0, 0.0, 0.0]])
    log_q = jnp.log(jnp.array([[1.2, 1.0, 1.0], [1.0, 1.0, 1.0]]))
    mask = jnp.array([[1, 1, 0], [0, 0, 0]])
    pen = obj.kl_reward_penalty(logp, ref, log_q, mask, beta=0.1)
    k1 = (-1.0 - (-1.5 + np.log(1.2))) + (-2.0 - (-1.0))
    np.testing.assert_allclose(pen, [-0.1 * k1, 0.0], rtol=1e-5)


# --------------------------------------------------------------------------------------------------- bandit
# One categorical step over V tokens, exact expectation over y ~ pi. Each term is used as in the real loss: pi_y is a
# stop-grad sampling weight, the gradient flows through logp_y of the per-token surrogate and KL values.

V = 6
LOG_REF = jax.nn.log_softmax(jnp.array([0.5, -1.0, 0.2, 1.0, -0.5, 0.0]))
LOG_Q = jnp.log(jnp.array([1.4, 0.6, 1.0, 1.2, 0.8, 1.0]))
REWARD = jnp.array([1.0, 0.0, 0.5, 0.0, 1.0, 0.2])
BETA = 0.5


def _bandit_loss(logits_V, estimator, log_q_V=LOG_Q, reward_V=REWARD, beta=BETA, kl_in_reward=False):
    logp_V = jax.nn.log_softmax(logits_V)
    pi_V = sg(jnp.exp(logp_V))
    ones_Vx1 = jnp.ones((V, 1))
    if kl_in_reward:
        adv_V = reward_V + obj.kl_reward_penalty(logp_V[:, None], LOG_REF[:, None], log_q_V[:, None], ones_Vx1, beta)
        kl_V = 0.0
    else:
        adv_V = reward_V
        kl_V = obj.kl_term(logp_V, LOG_REF, log_q_V, estimator)
    pg_Vx1, _ = obj.policy_surrogate(logp_V[:, None], sg(logp_V)[:, None], adv_V, ones_Vx1, eps_low=1e9,
                                     eps_high=1e9)
    return jnp.sum(pi_V * (pg_Vx1[:, 0] + beta * kl_V))


bandit_grad = jax.jit(jax.grad(_bandit_loss), static_argnums=(1,))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _converge(estimator, kl_in_reward=False):
    grad = jax.grad(_bandit_loss)
    step = lambda _, z: z - 2.0 * grad(z, estimator, kl_in_reward=kl_in_reward)
    return jax.nn.softmax(jax.lax.fori_loop(0, 20000, step, LOG_REF))


def _tilt():
    return np.asarray(jax.nn.softmax(LOG_REF + LOG_Q + REWARD / BETA))


def _tv(a, b):
    return 0.5 * np.abs(np.asarray(a) - np.asarray(b)).sum()


@pytest.mark.parametrize("estimator,kl_in_reward", [("k2", False), ("k3+", False), ("k1", True)])
def test_bandit_exact_pseudo_kl_gradient_reaches_guided_tilt(estimator, kl_in_reward):
    pi = _converge(estimator, kl_in_reward)
    assert _tv(pi, _tilt()) < 1e-3  # pi* = q pi_ref exp(r / beta) / Z


def test_bandit_k3_reaches_its_own_fixed_point_not_the_tilt():
    pi = np.asarray(_converge("k3"))
    m = np.exp(np.asarray(LOG_REF + LOG_Q))
    r = np.asarray(REWARD)
    rbar = float(pi @ r)
    assert np.all(BETA * m.sum() > r - rbar)
    fixed_point = BETA * m / (BETA * m.sum() - (r - rbar))
    assert _tv(pi, fixed_point) < 1e-3
    assert abs(fixed_point.sum() - 1.0) < 1e-3  # rbar is self-consistent
    assert _tv(pi, _tilt()) > 0.03  # and it is measurably not the paper's stationary solution


def test_bandit_forward_gradient_is_forward_kl_gradient():
    logits = jnp.array([0.3, -0.7, 1.1, 0.0, -0.2, 0.4])
    zero_r = jnp.zeros(V)
    for log_q in (jnp.zeros(V), LOG_Q):
        log_m = LOG_REF + log_q

        def exact(z):  # generalised forward KL(m || pi) = sum m log(m / pi) - sum m + 1
            return jnp.sum(jnp.exp(log_m) * (log_m - jax.nn.log_softmax(z))) - jnp.exp(log_m).sum() + 1.0

        g = bandit_grad(logits, "forward", log_q, zero_r, 1.0)
        np.testing.assert_allclose(g, jax.grad(exact)(logits), atol=1e-6)
        value = jnp.sum(jax.nn.softmax(logits) * kl_term(jax.nn.log_softmax(logits), LOG_REF, log_q, "forward"))
        np.testing.assert_allclose(value, exact(logits), rtol=1e-5)
        # the reference's k3 has the same expected gradient: it anchors like a forward KL
        np.testing.assert_allclose(bandit_grad(logits, "k3", log_q, zero_r, 1.0), jax.grad(exact)(logits),
                                   atol=1e-6)


def test_bandit_k2_gradient_is_reverse_pseudo_kl_gradient():
    logits = jnp.array([0.3, -0.7, 1.1, 0.0, -0.2, 0.4])
    log_m = LOG_REF + LOG_Q

    def exact(z):  # pseudo-KL(pi || m) = sum pi log(pi / m) - pi + m
        logp = jax.nn.log_softmax(z)
        return jnp.sum(jnp.exp(logp) * (logp - log_m) - jnp.exp(logp) + jnp.exp(log_m))

    for est in ("k2", "k3+"):
        g = bandit_grad(logits, est, LOG_Q, jnp.zeros(V), 1.0)
        np.testing.assert_allclose(g, jax.grad(exact)(logits), atol=1e-6)


def test_bandit_token_independent_q_cancels_for_k2_but_scales_k3():
    # a branch guide's q depends on the position, not on the token chosen there
    logits = jnp.array([0.3, -0.7, 1.1, 0.0, -0.2, 0.4])
    zero_r, const_q = jnp.zeros(V), jnp.full((V,), jnp.log(1.3))
    grad = bandit_grad
    np.testing.assert_allclose(grad(logits, "k2", const_q, zero_r, 1.0), grad(logits, "k2", jnp.zeros(V), zero_r, 1.0),
                               atol=1e-6)
    np.testing.assert_allclose(grad(logits, "k3", const_q, zero_r, 1.0),
                               1.3 * grad(logits, "k3", jnp.zeros(V), zero_r, 1.0), atol=1e-6)


# --------------------------------------------------------------------------------------------------- two-step tree
# Completions y = (a, b): a in {0, 1}, then b in {0, 1} given a. The policy's probabilities are multiples of 1/8, so
# one group of 8 rows holding each leaf as often as pi samples it makes every estimator's batch value its exact
# expectation under pi (the whole outcome space, enumerated with its weights).

TREE_LEAVES = np.array([[0, 0], [0, 1], [0, 1], [0, 1], [1, 0], [1, 0], [1, 1], [1, 1]])  # pi: 1/8, 3/8, 2/8, 2/8
TREE_PI = (jnp.log(jnp.array([0.5, 0.5])), jnp.log(jnp.array([[0.25, 0.75], [0.5, 0.5]])))
TREE_REF = (jnp.log(jnp.array([0.6, 0.4])), jnp.log(jnp.array([[0.25, 0.75], [0.95, 0.05]])))
# Branch with tau 0.6 lifts q where pi's entropy exceeds 0.6 nats: at step 1 and after a = 1, not after a = 0
TREE_GUIDE = guides.GuideConfig(name="branch", gamma=1.0, tau=0.6)


def _tree_rows(z):
    """(logp [8, 2], entropy [8, 2]) of the leaves under logits z = (z1 [2], z2 [2, 2])."""
    lp1, lp2 = jax.nn.log_softmax(z[0]), jax.nn.log_softmax(z[1], -1)
    a, b = TREE_LEAVES[:, 0], TREE_LEAVES[:, 1]
    entropy = lambda lp: -jnp.sum(jnp.exp(lp) * lp, -1)
    logp = jnp.stack([lp1[a], lp2[a, b]], -1)
    return logp, sg(jnp.stack([jnp.broadcast_to(entropy(lp1), (8,)), entropy(lp2)[a]], -1))


def _tree_grad(estimator, kl_in_reward=False):
    ref_logp = _tree_rows(TREE_REF)[0]
    loss_cfg = obj.LossConfig(kl_estimator=estimator, beta=1.0, kl_in_reward=kl_in_reward, adv_scale="none",
                              guide=TREE_GUIDE)

    def loss(z):
        logp, entropy = _tree_rows(z)
        mask = jnp.ones((8, 2))
        log_q = guides.compute_log_q("branch", logp, entropy, mask, None, TREE_GUIDE)
        batch = {"completion_mask": mask, "old_logp": sg(logp), "ref_logp": ref_logp, "advantages": jnp.zeros(8),
                 "seq_kl_coef": obj.forward_kl_coefficients(sg(logp), ref_logp, log_q, mask, 8)}
        if kl_in_reward:
            penalty = obj.kl_reward_penalty(logp, ref_logp, log_q, mask, 1.0)
            batch["advantages"] = obj.group_advantages(penalty, 8, scale="none")
        return obj.loss_from_logprobs(logp, entropy, batch, loss_cfg)[0]
    return jax.grad(loss)(TREE_PI)


def _relative_gap(grads, exact):
    flat = lambda g: np.concatenate([np.ravel(x) for x in g])
    return np.linalg.norm(flat(grads) - flat(exact)) / np.linalg.norm(flat(exact))


def _tree_anchor():
    """log m(y) over the 4 leaves (q from pi's entropies, fixed) and log pi(y) as a function of z."""
    logp, entropy = _tree_rows(TREE_PI)
    log_q = guides.compute_log_q("branch", logp, entropy, jnp.ones((8, 2)), None, TREE_GUIDE)
    log_m = (_tree_rows(TREE_REF)[0] + log_q).sum(-1)[np.array([0, 1, 4, 6])]
    log_pi = lambda z: _tree_rows(z)[0].sum(-1)[np.array([0, 1, 4, 6])]
    return log_m, log_pi


def test_two_step_tree_forward_seq_is_the_forward_kl_over_completions_and_k3_is_not():
    log_m, log_pi = _tree_anchor()
    m_tilde = jax.nn.softmax(log_m)
    # KL(m~ || pi) over the 4 completions, / 2 tokens (the GRPO aggregation's per-token mean)
    exact = jax.grad(lambda z: jnp.sum(m_tilde * (jnp.log(m_tilde) - log_pi(z))) / 2)(TREE_PI)
    got, k3 = _tree_grad("forward-seq"), _tree_grad("k3")
    for g, e in zip(got, exact):
        np.testing.assert_allclose(g, e, atol=1e-6)
    # per token, k3 and the importance-weighted forward term weigh prefixes by pi, not by m~: another gradient
    assert _relative_gap(k3, exact) > 0.2 and _relative_gap(_tree_grad("forward"), exact) > 0.2


def test_two_step_tree_k1_in_reward_is_the_reverse_kl_over_completions_and_k2_is_not():
    log_m, log_pi = _tree_anchor()
    # pseudo-KL(pi || m) = sum_y pi log(pi / m) - pi + m over the 4 completions, / 2 tokens
    exact = jax.grad(lambda z: jnp.sum(jnp.exp(log_pi(z)) * (log_pi(z) - log_m) - jnp.exp(log_pi(z))) / 2)(TREE_PI)
    got, k2 = _tree_grad("k1", kl_in_reward=True), _tree_grad("k2")
    for g, e in zip(got, exact):
        np.testing.assert_allclose(g, e, atol=1e-6)
    assert _relative_gap(k2, exact) > 0.2  # per position only: blind to how step 1 changes the KL that follows it


# --------------------------------------------------------------------------------------------------- surrogate

def test_clipping_hand_numbers():
    ratio = np.array([1.5, 0.5, 1.1, 5.0])
    old = jnp.full((2, 4), -1.0)
    logp = old + jnp.log(jnp.asarray(ratio))
    mask = jnp.ones((2, 4))
    adv = jnp.array([1.0, -1.0])
    pg, stats = obj.policy_surrogate(logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    np.testing.assert_allclose(pg, [[-1.28, -0.5, -1.1, -1.28], [1.5, 0.8, 1.1, 5.0]], rtol=1e-5)
    assert float(stats["rl/clip_frac_high"]) == pytest.approx(2 / 8)  # A>0 and ratio>1.28
    assert float(stats["rl/clip_frac_low"]) == pytest.approx(1 / 8)  # A<0 and ratio<0.8
    assert float(stats["rl/ratio_mean"]) == pytest.approx(ratio.mean(), rel=1e-5)
    pg_dual, _ = obj.policy_surrogate(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip=3.0)
    np.testing.assert_allclose(pg_dual, [[-1.28, -0.5, -1.1, -1.28], [1.5, 0.8, 1.1, 3.0]], rtol=1e-5)
    sampler = old - jnp.log(jnp.array([[2.0, 0.5, 1.0, 20.0]] * 2))  # weights old/sampler = 2, .5, 1, 20 -> cap 4
    pg_tis, _ = obj.policy_surrogate(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, sampler_logp_NxC=sampler,
                                     tis_cap=4.0)
    np.testing.assert_allclose(pg_tis, np.asarray(pg) * np.array([2.0, 0.5, 1.0, 4.0]), rtol=1e-5)


def test_clipped_tokens_get_no_gradient():
    old = jnp.zeros((1, 2))
    logp = jnp.log(jnp.array([[1.5, 1.1]]))
    g = jax.grad(lambda lp: obj.policy_surrogate(lp, old, jnp.ones(1), jnp.ones((1, 2)))[0].sum())(logp)
    np.testing.assert_allclose(g, [[0.0, -1.1]], rtol=1e-6)


def test_aggregation_modes_hand_numbers():
    loss = jnp.array([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = jnp.array([[1, 1, 1], [1, 0, 0]])
    assert float(obj.aggregate(loss, mask, "seq-mean-token-mean")) == pytest.approx((2.0 + 4.0) / 2)
    assert float(obj.aggregate(loss, mask, "token-mean")) == pytest.approx(10.0 / 4)
    assert float(obj.aggregate(loss, mask, "seq-mean-token-sum-norm")) == pytest.approx((6.0 / 3 + 4.0 / 3) / 2)
    assert float(obj.aggregate(loss, mask, "seq-mean-token-sum-norm", norm_len=10)) == pytest.approx(0.5)
    assert float(obj.aggregate(loss, jnp.zeros_like(mask), "token-mean")) == 0.0
    with pytest.raises(ValueError, match="aggregation"):
        obj.aggregate(loss, mask, "sum")


# --------------------------------------------------------------------------------------------------- loss

def _random_batch(key, n=4, c=5):
    k = jax.random.split(key, 5)
    logp = -jax.random.uniform(k[0], (n, c), minval=0.1, maxval=3.0)
    mask = jnp.ones((n, c)).at[1, 3:].set(0).at[3, :].set(0)
    return logp, jax.random.uniform(k[1], (n, c), maxval=3.0), {
        "completion_mask": mask,
        "advantages": jax.random.normal(k[2], (n,)),
        "old_logp": logp + 0.3 * jax.random.normal(k[3], (n, c)),
        "ref_logp": logp + 0.5 * jax.random.normal(k[4], (n, c)),
        "truncated": jnp.array([False, True, False, False]),
    }


def _plain_grpo(logp, batch, beta, eps):
    """Independent GRPO (k3 to pi_ref, seq-mean-token-mean) written out directly."""
    mask = np.asarray(batch["completion_mask"])
    ratio = np.exp(np.asarray(logp - batch["old_logp"]))
    a = np.asarray(batch["advantages"])[:, None]
    pg = -np.minimum(ratio * a, np.clip(ratio, 1 - eps, 1 + eps) * a)
    d = np.asarray(batch["ref_logp"] - logp)
    per_token = pg + beta * (np.exp(d) - d - 1)
    return np.mean((per_token * mask).sum(-1) / np.maximum(mask.sum(-1), 1))


def test_dr_grpo_normaliser_is_the_configured_length_not_the_bucket():
    from sage_jax.run import config as config_lib
    from sage_jax.training import trainer
    config = config_lib.load("configs/tiny_test.py", ["--config.loss.aggregation=seq-mean-token-sum-norm",
                                                      "--config.rollout.max_new_tokens=16"])
    loss_cfg = dataclasses.replace(trainer.loss_config(config), beta=0.0, guide=guides.GuideConfig())
    assert loss_cfg.norm_len == 16
    logp, entropy, batch = _random_batch(jax.random.PRNGKey(3), c=4)
    pad = lambda x, width: jnp.pad(x, ((0, 0), (0, width - x.shape[1])))
    wide = {k: (pad(v, 8) if k != "advantages" and v.ndim == 2 else v) for k, v in batch.items()}
    # the same completions trimmed to a 4- or an 8-wide bucket: one loss
    assert float(loss_from_logprobs(logp, entropy, batch, loss_cfg)[0]) == pytest.approx(
        float(loss_from_logprobs(pad(logp, 8), pad(entropy, 8), wide, loss_cfg)[0]), rel=1e-6)


@pytest.mark.parametrize("aggregation", obj.AGGREGATIONS)
def test_grad_accumulation_equals_full_batch_with_unequal_lengths(aggregation):
    import optax
    from sage_jax.training import state as train_state
    logp, entropy, batch = _random_batch(jax.random.PRNGKey(4), n=8, c=6)
    batch["completion_mask"] = (jnp.arange(6)[None] < jnp.array([6, 1, 5, 2, 6, 1, 3, 1])[:, None]).astype(jnp.float32)
    batch["row"] = jnp.arange(8)
    loss_cfg = obj.LossConfig(kl_estimator="k3", beta=0.1, aggregation=aggregation)

    def loss_fn(params, mb, cfg, loss_cfg, step, key):
        return obj.loss_from_logprobs(params["logp"][mb["row"]], entropy[mb["row"]], mb, loss_cfg, step, key)

    grads = []
    for accum in (1, 2, 4):
        step = train_state.make_train_step(None, loss_cfg, optax.sgd(1.0), lambda s: 1.0, seed=0, grad_accum=accum,
                                       loss_fn=loss_fn)
        state = {"step": jnp.int32(0), "params": {"logp": jnp.copy(logp)}, "opt_state": optax.sgd(1.0).init(None)}
        new_state, _ = step(state, {**batch, "rl_step": jnp.int32(0)})
        grads.append(np.asarray(logp - new_state["params"]["logp"]))
    for g in grads[1:]:
        np.testing.assert_allclose(g, grads[0], rtol=1e-5, atol=1e-7)


def test_q_one_gives_plain_grpo_loss():
    logp, entropy, batch = _random_batch(jax.random.PRNGKey(0))
    base = obj.LossConfig(kl_estimator="k3", beta=0.05)
    loss_none, _ = loss_from_logprobs(logp, entropy, batch, base)
    q_one = obj.LossConfig(kl_estimator="k3", beta=0.05, guide=guides.GuideConfig(name="branch", tau=100.0))
    loss_branch, metrics = loss_from_logprobs(logp, entropy, batch, q_one)
    assert float(loss_branch) == float(loss_none)
    assert float(metrics["sage/q_max"]) == 1.0 and float(metrics["sage/q_frac_above_1"]) == 0.0
    assert float(loss_none) == pytest.approx(_plain_grpo(logp, batch, 0.05, 0.2), rel=1e-5)
    # and a live guide does change it
    loss_live, metrics_live = loss_from_logprobs(logp, entropy + 110.0, batch, q_one)
    assert float(metrics_live["sage/q_min"]) == pytest.approx(1.4) and float(loss_live) != float(loss_none)


def test_loss_modes_mask_truncated_and_kl_in_reward():
    logp, entropy, batch = _random_batch(jax.random.PRNGKey(1))
    plain = obj.LossConfig(beta=0.0)
    loss_masked, m = loss_from_logprobs(logp, entropy, batch, obj.LossConfig(beta=0.0, mask_truncated=True))
    batch_without_row1 = dict(batch, completion_mask=batch["completion_mask"].at[1].set(0))
    assert float(loss_masked) == pytest.approx(float(loss_from_logprobs(logp, entropy, batch_without_row1,
                                                                            plain)[0]), rel=1e-6)
    in_reward = obj.LossConfig(beta=0.05, kl_in_reward=True)
    loss_r, m_r = loss_from_logprobs(logp, entropy, batch, in_reward)
    assert float(loss_r) == pytest.approx(float(loss_from_logprobs(logp, entropy, batch, plain)[0]), rel=1e-6)
    assert float(m_r["loss/kl"]) == 0.0 and float(m_r["rl/kl"]) > 0.0
    _, m_k3 = loss_from_logprobs(logp, entropy, batch, obj.LossConfig(beta=0.05))
    assert float(m_k3["loss/total"]) == pytest.approx(float(m_k3["loss/policy"] + m_k3["loss/kl"]), rel=1e-5)


def test_loss_config_from_config_dict():
    loss = ml_collections.ConfigDict({"kl_estimator": "k3+", "beta": 0.1, "guide": "branch", "tau": 1.0,
                                      "eps_high": 0.28, "aggregation": "token-mean", "token_quantiles": (0.05, 0.95)})
    cfg = obj.LossConfig.from_config(loss, total_steps=500)
    assert cfg.kl_estimator == "k3+" and cfg.beta == 0.1 and cfg.eps_high == 0.28 and cfg.aggregation == "token-mean"
    assert cfg.guide.name == "branch" and cfg.guide.tau == 1.0 and cfg.guide.schedule_steps == 500
    hash(cfg)
    with pytest.raises(ValueError, match="kl_estimator"):
        obj.LossConfig(kl_estimator="reverse")
    with pytest.raises(ValueError, match="dual_clip"):
        obj.LossConfig(dual_clip=0.5)


def test_loss_fn_jits_on_tiny_model_with_finite_grads_for_padding_row():
    cfg = model_lib.PRESETS["tiny"].replace(num_layers=1)
    params = jax.jit(model_lib.init_params, static_argnums=0)(cfg, jax.random.PRNGKey(0))
    n, p, c = 4, 3, 5
    tokens = jax.random.randint(jax.random.PRNGKey(1), (n, p + c), 1, cfg.vocab_size)
    prompt_mask = jnp.ones((n, p)).at[0, 0].set(0)  # row 0 is left padded
    completion_mask = jnp.ones((n, c)).at[1, 3:].set(0).at[3, :].set(0)  # row 3 is all padding
    tokens = tokens * jnp.concatenate([prompt_mask, completion_mask], 1).astype(tokens.dtype)
    mask = jnp.concatenate([prompt_mask, completion_mask], 1)
    loss_cfg = obj.LossConfig(kl_estimator="k3", beta=0.05, tis_cap=2.0, guide=guides.GuideConfig(name="token"))

    @jax.jit
    def run(params, tokens, mask, completion_mask):
        # logp of completion token j, read off the full logits at position P + j - 1
        logp_all = jax.nn.log_softmax(model_lib.forward(cfg, params, tokens, mask_BxT=mask), -1)
        exact = jnp.take_along_axis(logp_all[:, p - 1:-1], tokens[:, p:, None], -1)[..., 0]
        batch = {"tokens": tokens, "mask": mask, "completion_mask": completion_mask,
                 "advantages": jnp.array([1.0, -1.0, 0.5, 0.0]), "ref_logp": exact, "old_logp": exact,
                 "sampler_logp": exact, "truncated": jnp.zeros(n, bool)}
        return jax.value_and_grad(obj.loss_fn, has_aux=True)(params, batch, cfg, loss_cfg, 3, jax.random.PRNGKey(2))

    (loss, metrics), grads = run(params, tokens, mask, completion_mask)
    assert np.isfinite(float(loss))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree_util.tree_leaves(grads))
    expected_keys = {"loss/policy", "rl/kl", "rl/entropy", "sage/q_mean", "sage/q_min", "sage/q_max",
                     "sage/q_frac_above_1", "rl/clip_frac_low", "rl/clip_frac_high", "rl/ratio_mean", "rl/adv_mean",
                     "rl/adv_std", "rl/adv_max", "rl/adv_min", "rl/response_len", "loss/total"}
    assert expected_keys <= set(metrics) and all(np.ndim(v) == 0 for v in metrics.values())
    # right alignment: the trainer-side logprobs match, so the ratio is 1 and the KL to pi_ref is 0
    assert float(metrics["rl/ratio_mean"]) == pytest.approx(1.0, abs=1e-4)
    assert float(metrics["rl/kl_ref"]) == pytest.approx(0.0, abs=1e-5)
    assert float(metrics["rl/response_len"]) == pytest.approx((5 + 3 + 5 + 0) / 4)
    assert float(metrics["sage/q_max"]) > 1.0


# --------------------------------------------------------------------------------------------------- peers' options

def _categorical_batch(n=2, c=3, v=4, seed=0):
    """Logits [n, c, v] with sampled tokens: logp / entropy of each position as functions of the logits."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    z = jax.random.normal(k1, (n, c, v))
    tokens = jax.random.randint(k2, (n, c), 0, v)

    def rows(z):
        lp = jax.nn.log_softmax(z, -1)
        return (jnp.take_along_axis(lp, tokens[..., None], -1)[..., 0], -jnp.sum(jnp.exp(lp) * lp, -1))
    return z, rows


def test_entropy_bonus_gradient_is_the_exact_entropy_gradient_at_each_position():
    z, rows = _categorical_batch()
    mask = jnp.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    cfg = obj.LossConfig(beta=0.0, entropy_coef=0.1)

    def loss(z, cfg):
        logp, ent = rows(z)
        batch = {"completion_mask": mask, "advantages": jnp.zeros(2), "old_logp": sg(logp), "ref_logp": sg(logp)}
        return obj.loss_from_logprobs(logp, ent, batch, cfg)[0]
    g = jax.grad(loss)(z, cfg)
    # seq-mean-token-mean of -0.1 * H(z_nt): each real position gets -0.1 / (N * C_n) * grad H(z_nt), not a sample
    entropy = lambda zz: -jnp.sum(jax.nn.softmax(zz) * jax.nn.log_softmax(zz))
    weights = np.array([[1 / 6, 1 / 6, 1 / 6], [1 / 4, 1 / 4, 0.0]])
    for i in range(2):
        for t in range(3):
            np.testing.assert_allclose(g[i, t], -0.1 * weights[i, t] * jax.grad(entropy)(z[i, t]), atol=1e-7)
    assert float(loss(z, cfg)) == pytest.approx(-0.1 * float((rows(z)[1] * weights).sum()), rel=1e-6)
    assert not np.any(np.asarray(jax.grad(loss)(z, obj.LossConfig(beta=0.0))))  # off: no gradient at A = 0


def test_top_entropy_mask_trains_only_the_top_share_of_tokens_and_keeps_the_kl_on_all():
    entropy = jnp.array([[0.1, 0.9, 0.5, 2.0, 0.3, 7.0], [0.2, 0.8, 1.5, 0.4, 0.6, 5.0]])
    mask = jnp.ones((2, 6)).at[:, 5].set(0)  # 10 real tokens; the padding's large entropies must not count
    logp = jnp.full((2, 6), -1.0)
    batch = {"completion_mask": mask, "advantages": jnp.array([1.0, -1.0]), "old_logp": logp,
             "ref_logp": logp - 0.5}
    grad = lambda cfg: np.asarray(jax.grad(lambda lp: obj.loss_from_logprobs(lp, entropy, batch, cfg)[0])(logp))
    # the 0.8 quantile of the 10 real entropies lies between 0.9 and 1.5: exactly 2.0 and 1.5 are kept (top 20%)
    kept = np.zeros((2, 6), bool)
    kept[0, 3] = kept[1, 2] = True
    g = grad(obj.LossConfig(beta=0.0, top_entropy_quantile=0.2))
    assert np.array_equal(g != 0, kept)
    np.testing.assert_allclose(g[kept], grad(obj.LossConfig(beta=0.0))[kept], rtol=1e-6)  # same normaliser (TRL)
    # the KL anchor still acts on every real token
    with_kl = grad(obj.LossConfig(beta=0.1, top_entropy_quantile=0.2))
    assert np.array_equal(with_kl != 0, np.asarray(mask) > 0)
    masked_out = ~kept & (np.asarray(mask) > 0)  # there, only the KL's gradient is left
    only_kl = grad(obj.LossConfig(beta=0.1)) - grad(obj.LossConfig(beta=0.0))
    np.testing.assert_allclose(with_kl[masked_out], only_kl[masked_out], rtol=1e-5)
    _, m = loss_from_logprobs(logp, entropy, batch, obj.LossConfig(beta=0.0, top_entropy_quantile=0.2))
    assert float(m["rl/pg_token_frac"]) == pytest.approx(0.2)
    # keep 0.0: only the single highest-entropy token; keep 1.0: every token (the option is off)
    assert (grad(obj.LossConfig(beta=0.0, top_entropy_quantile=0.0)) != 0).sum() == 1
    assert np.array_equal(grad(obj.LossConfig(beta=0.0, top_entropy_quantile=1.0)), grad(obj.LossConfig(beta=0.0)))


def _kl_cov_case():
    # 2 rows x 3 tokens, one padded. Means over the 5 real tokens: A 0.2, log pi -1.0.
    # cov = (A - 0.2) * (logp + 1): row 0 (A = 1): 0.8 * (0.5, -0.5, 1.0); row 1 (A = -1): -1.2 * (-0.6, -0.4, pad)
    logp = jnp.array([[-0.5, -1.5, 0.0], [-1.6, -1.4, -3.0]])
    mask = jnp.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return logp, mask, jnp.array([1.0, -1.0])  # covs 0.4, -0.4, 0.8, 0.72, 0.48


def test_kl_cov_selects_the_highest_covariance_tokens_and_is_inert_on_policy():
    logp, mask, adv = _kl_cov_case()
    pen, selected = obj.kl_cov_penalty(logp, logp, adv, mask, ratio=0.4, coef=1.0)  # floor(0.4 * 5) = 2 tokens
    assert np.array_equal(np.asarray(selected), [[0, 0, 1], [1, 0, 0]])  # cov 0.8 and 0.72
    assert np.array_equal(np.asarray(obj.kl_cov_penalty(logp, logp, adv, mask, 0.0001, 1.0)[1]),
                          [[0, 0, 1], [0, 0, 0]])  # at least one token
    batch = {"completion_mask": mask, "advantages": adv, "old_logp": logp, "ref_logp": logp - 0.3}
    loss_grad = lambda lp, cfg, b: jax.grad(lambda x: obj.loss_from_logprobs(x, jnp.zeros_like(x), b, cfg)[0])(lp)
    grpo, kl_cov = obj.LossConfig(beta=0.1), obj.LossConfig(beta=0.1, kl_cov_ratio=0.4, kl_cov_coef=2.0)
    # on policy (pi = pi_old) the |log pi - log pi_old| penalty has no gradient: exactly GRPO's
    np.testing.assert_array_equal(loss_grad(logp, kl_cov, batch), loss_grad(logp, grpo, batch))
    # after an update: coef * sign(log pi - log pi_old) on the selected tokens, / the aggregation's token counts
    moved = logp + jnp.array([[0.05, -0.05, 0.05], [-0.05, 0.05, 0.0]])
    extra = np.asarray(loss_grad(moved, kl_cov, batch) - loss_grad(moved, grpo, batch))
    expected = np.zeros((2, 3))
    expected[0, 2], expected[1, 0] = 2.0 * 1 / (2 * 3), 2.0 * -1 / (2 * 2)  # seq-mean-token-mean weights
    np.testing.assert_allclose(extra, expected, atol=1e-6)
    _, m = loss_from_logprobs(moved, jnp.zeros_like(moved), batch, kl_cov)
    assert float(m["rl/kl_cov_frac"]) == pytest.approx(2 / 5) and float(m["loss/kl_cov"]) > 0
    with pytest.raises(ValueError, match="kl_cov_ratio"):
        obj.LossConfig(kl_cov_ratio=2.0)


def _countdown_loss(arm):
    from sage_jax.run import config as config_lib
    from sage_jax.training import trainer
    return trainer.loss_config(config_lib.load(f"configs/countdown_arms.py:{arm},tiny", []))


def test_paper_form_branch_arm_is_the_exact_reverse_kl_to_q_pi_ref_over_completions():
    # the arm's estimator with the tree's guide (so q acts) and no std scaling: its expected gradient over the whole
    # tree is that of -(E_pi[r] - beta * pseudo-KL(pi || q pi_ref)) / 2 tokens, whose stationary point is the
    # paper's pi* = q pi_ref exp(r / beta) / Z over completions; the authors' form (k3 in the loss) has another
    paper, authors = _countdown_loss("grpo_branch_paper"), _countdown_loss("grpo_branch")
    assert paper.guide.name == authors.guide.name == "branch"
    assert (paper.kl_estimator, paper.kl_in_reward) == ("k1", True)
    reward = jnp.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])  # per leaf row: y = (0,0) and (1,0) are correct
    log_m, log_pi = _tree_anchor()
    r_leaf = reward[np.array([0, 1, 4, 6])]
    beta = paper.beta

    def objective(z):
        lp = log_pi(z)
        pi = jnp.exp(lp)
        return -(jnp.sum(pi * r_leaf) - beta * jnp.sum(pi * (lp - log_m) - pi)) / 2
    exact = jax.grad(objective)(TREE_PI)
    tree_cfg = lambda lc: dataclasses.replace(lc, adv_scale="none", guide=TREE_GUIDE)
    got = _tree_grad_with(tree_cfg(paper), reward)
    for g, e in zip(got, exact):
        np.testing.assert_allclose(g, e, atol=1e-6)
    assert _relative_gap(_tree_grad_with(tree_cfg(authors), reward), exact) > 0.05


def _tree_grad_with(loss_cfg, reward_rows):
    """Expected gradient over the tree of loss_cfg's loss with rewards per leaf row (one group of 8)."""
    ref_logp = _tree_rows(TREE_REF)[0]
    guide = loss_cfg.guide

    def loss(z):
        logp, entropy = _tree_rows(z)
        mask = jnp.ones((8, 2))
        log_q = guides.compute_log_q(guide.name, logp, entropy, mask, None, guide)
        r = reward_rows
        if loss_cfg.kl_in_reward:
            r = r + obj.kl_reward_penalty(logp, ref_logp, log_q, mask, loss_cfg.beta)
        adv = obj.group_advantages(r, 8, scale=loss_cfg.adv_scale)
        batch = {"completion_mask": mask, "old_logp": sg(logp), "ref_logp": ref_logp, "advantages": adv}
        return obj.loss_from_logprobs(logp, entropy, batch, loss_cfg)[0]
    return jax.grad(loss)(TREE_PI)


@pytest.mark.parametrize("aggregation", obj.AGGREGATIONS)
def test_forward_seq_is_the_sequence_level_forward_kl_gradient_for_unequal_lengths(aggregation):
    """-(beta / (N L)) sum_i c_i grad log pi(y_i) on completions of lengths 5, 1, 3, 2 under every aggregation (a
    per-row token mean would weigh row i by 1/|y_i|)."""
    N, C, V, beta = 4, 5, 3, 0.7
    z = jax.random.normal(jax.random.key(0), (N, C, V))
    tokens = jax.random.randint(jax.random.key(1), (N, C), 0, V)
    mask = (jnp.arange(C)[None, :] < jnp.array([5, 1, 3, 2])[:, None]).astype(jnp.float32)
    ref_logp = jax.random.normal(jax.random.key(2), (N, C)) - 1.0
    logp_of = lambda z: jnp.take_along_axis(jax.nn.log_softmax(z, -1), tokens[..., None], -1)[..., 0]
    coef = obj.forward_kl_coefficients(sg(logp_of(z)), ref_logp, None, mask, N)
    assert np.ptp(np.asarray(coef)) > 0.1  # the rows do get different weights
    loss_cfg = obj.LossConfig(kl_estimator="forward-seq", beta=beta, aggregation=aggregation, adv_scale="none")

    def loss(z):
        logp = logp_of(z)
        batch = {"completion_mask": mask, "old_logp": sg(logp), "ref_logp": ref_logp, "advantages": jnp.zeros(N),
                 "seq_kl_coef": coef}
        batch = obj.with_batch_normaliser(batch, loss_cfg)
        return obj.loss_from_logprobs(logp, jnp.zeros_like(logp), batch, loss_cfg)[0]

    exact = jax.grad(lambda z: -beta / (N * C) * jnp.sum(coef * (logp_of(z) * mask).sum(-1)))(z)
    np.testing.assert_allclose(jax.grad(loss)(z), exact, atol=1e-6)
