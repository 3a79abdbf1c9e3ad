"""Observed tokens (a tool's output inside a multi-turn row) are context, never trained: changing their log-probs,
entropies, reference or behaviour log-probs (NaN or not) changes no loss term, no metric and no gradient, under every
part of the loss (policy surrogate, ratios and TIS, KL anchor, SAGE guides, entropy and KL-Cov options, normalisers).
A NaN behaviour log-prob on a sampled token fails the step's finite-loss check."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax.rl import guides
from sage_jax.rl import objectives as obj

N, C = 4, 10
# completion lengths 10, 8, 10, 6; observed spans (tool output) inside rows 0, 1 and 2
COMPLETION = np.arange(C)[None, :] < np.array([10, 8, 10, 6])[:, None]
SAMPLED = COMPLETION.copy()
SAMPLED[0, 3:6] = SAMPLED[1, 2:4] = SAMPLED[2, 5:9] = False
OBSERVED = COMPLETION & ~SAMPLED

CONFIGS = {
    "sage-branch, tis, dual clip, entropy, kl-cov, top-entropy": obj.LossConfig(
        guide=guides.GuideConfig(name="branch"), tis_cap=2.0, dual_clip=3.0, entropy_coef=0.01,
        kl_cov_ratio=0.2, top_entropy_quantile=0.8),
    "sage-token, token-mean": obj.LossConfig(guide=guides.GuideConfig(name="token"), aggregation="token-mean",
                                             kl_estimator="k2"),
    "sage-random, Dr.GRPO, forward": obj.LossConfig(guide=guides.GuideConfig(name="random"),
                                                    aggregation="seq-mean-token-sum-norm", kl_estimator="forward"),
    "forward-seq": obj.LossConfig(kl_estimator="forward-seq", mask_truncated=True),
}


def _inputs(seed: int, observed_value=None):
    """(logp, entropy, batch); observed_value: what the observed positions hold (None: the same draws as seed 0's,
    "nan": NaN behaviour log-probs, else a seed for other random values)."""
    rng = np.random.default_rng(0)
    logp = -rng.uniform(0.1, 3.0, (N, C))
    entropy = rng.uniform(0.0, 3.0, (N, C))
    sampler = logp + 0.2 * rng.normal(size=(N, C))
    ref = logp + 0.5 * rng.normal(size=(N, C))
    if observed_value is not None:
        other = np.random.default_rng(seed)
        for a in (logp, entropy, ref):
            a[OBSERVED] = other.uniform(-5.0, 0.0, OBSERVED.sum())
        sampler[OBSERVED] = np.nan if observed_value == "nan" else other.uniform(-5.0, 0.0, OBSERVED.sum())
    sampler[~COMPLETION] = 0.0
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    batch = {"completion_mask": f32(COMPLETION), "sampled_mask": f32(SAMPLED),
             "advantages": f32(rng.normal(size=N)), "sampler_logp": f32(sampler), "old_logp": f32(sampler),
             "ref_logp": f32(ref), "truncated": jnp.array([False, True, False, False]),
             "seq_kl_coef": f32(rng.normal(size=N))}
    return f32(logp), f32(entropy), batch


@functools.partial(jax.jit, static_argnums=(3,))
def _value_and_grads(logp, entropy, batch, loss_cfg):
    fn = lambda lp, ent: obj.loss_from_logprobs(lp, ent, batch, loss_cfg, 3, jax.random.key(7))
    return jax.value_and_grad(fn, argnums=(0, 1), has_aux=True)(logp, entropy)


def _loss_metrics_grads(loss_cfg, observed_value, seed):
    logp, entropy, batch = _inputs(seed, observed_value)
    (loss, metrics), grads = _value_and_grads(logp, entropy, obj.with_batch_normaliser(batch, loss_cfg), loss_cfg)
    return loss, metrics, grads


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_observed_tokens_change_no_term_and_no_gradient(name):
    loss_cfg = CONFIGS[name]
    base = _loss_metrics_grads(loss_cfg, "nan", 1)
    for observed_value, seed in (("values", 2), ("nan", 3)):
        other = _loss_metrics_grads(loss_cfg, observed_value, seed)
        assert np.isfinite(float(base[0])) and float(other[0]) == pytest.approx(float(base[0]), rel=1e-6, abs=1e-7)
        for key in base[1]:
            np.testing.assert_allclose(other[1][key], base[1][key], rtol=1e-5, atol=1e-7, err_msg=key)
        for g_base, g_other in zip(base[2], other[2]):
            np.testing.assert_allclose(g_other, g_base, rtol=1e-5, atol=1e-7)
            assert np.all(np.asarray(g_base)[OBSERVED] == 0.0) and np.isfinite(np.asarray(g_base)).all()
    assert np.abs(np.asarray(base[2][0])[SAMPLED]).sum() > 0  # the sampled tokens do train


def test_the_mask_is_the_sampled_tokens_everywhere():
    loss_cfg = CONFIGS["sage-token, token-mean"]
    _, metrics, _ = _loss_metrics_grads(loss_cfg, "nan", 1)
    assert float(metrics["rl/response_len"]) == pytest.approx(SAMPLED.sum() / N)
    # the same rows with the observed tokens simply gone give the same loss (token-mean over sampled tokens only)
    logp, entropy, batch = _inputs(1, "nan")
    keep = lambda a: jnp.where(jnp.asarray(SAMPLED), a, 0.0)
    dense = {**batch, "completion_mask": jnp.asarray(SAMPLED, jnp.float32), "sampled_mask": None,
             "sampler_logp": keep(batch["sampler_logp"]), "old_logp": keep(batch["old_logp"])}
    (with_obs, _), grads = _value_and_grads(logp, entropy, obj.with_batch_normaliser(batch, loss_cfg), loss_cfg)
    (without, _), dense_grads = _value_and_grads(logp, entropy, obj.with_batch_normaliser(dense, loss_cfg), loss_cfg)
    assert float(with_obs) == pytest.approx(float(without), rel=1e-6)
    np.testing.assert_allclose(grads[0], dense_grads[0], rtol=1e-5, atol=1e-8)


def test_a_nan_behaviour_logprob_on_a_sampled_token_fails_the_finite_check():
    logp, entropy, batch = _inputs(1, "nan")
    batch["sampler_logp"] = batch["sampler_logp"].at[0, 0].set(jnp.nan)
    loss_cfg = dataclasses.replace(obj.LossConfig(), tis_cap=2.0)
    assert np.isnan(float(_value_and_grads(logp, entropy, batch, loss_cfg)[0][0]))
