"""RL objective: KL estimators against the SAGE anchor m = q * pi_ref, clipped surrogate, loss_fn (the group
advantages it trains on are in advantages.py, importable from here as well).

Per token t of a sampled completion: loss_t = pg_t + beta * kl_t(logp_t; log m_t), log m_t = ref_logp_t + log q_t,
then aggregated over tokens and sequences. Which kl_t has which stationary policy and which expected gradient over
whole completions is worked out in the README ("Which KL estimator") and checked in tests/rl/test_objectives.py.

The per-token estimators (kl_term) all weigh prefixes by pi, so none of them is a forward KL over completions; the
"forward-seq" anchor is: it weighs each group's completions by m(y) / pi_old(y), self-normalised within the group
(forward_kl_coefficients, computed by the trainer before the batch is split), rather than drawing extra samples from
pi_ref, so it needs no second sampler pass and no reference-model decoding.

Beside the anchor, three options of the nearest peers (README "Which KL estimator", last table), each off by default:
  loss.entropy_coef          entropy bonus: - coef * aggregate(H_t), H_t the exact entropy of pi's next-token
                             distribution at each sampled position (its gradient is -coef * grad H there)
  loss.top_entropy_quantile  TRL's top_entropy_quantile: the policy-gradient term only on the real tokens whose
                             entropy is at or above the (1 - rho) quantile of this batch's (1.0 = every token)
  loss.kl_cov_ratio/_coef    verl's kl_cov: + coef * |log pi - log pi_old| on the ratio * (number of real tokens)
                             tokens with the largest (A - mean A)(log pi - mean log pi) over the batch
The quantile and the covariance are over the rows one loss call sees (a micro-batch under optim.grad_accum).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from sage_jax.rl import guides
from sage_jax.models import decoder as model_lib
from sage_jax.rl.advantages import ADV_ESTIMATORS, ADV_SCALES, check_groups, group_advantages, zero_variance_groups

KL_ESTIMATORS = ("k1", "k2", "k3", "k3+", "forward", "none")  # per token (kl_term)
SEQUENCE_ESTIMATORS = ("forward-seq",)  # over whole completions, per group (forward_kl_coefficients)
AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
LOG_RATIO_CLIP = 20.0  # exp(20) ~ 5e8: above it exp(d) goes on linearly (finite for tokens pi nearly excludes)

sg = jax.lax.stop_gradient


# --------------------------------------------------------------------------------------------------- KL terms

def kl_term(logp: jax.Array, ref_logp: jax.Array, log_q: jax.Array | None = None, estimator: str = "k3",
            mask: jax.Array | None = None) -> jax.Array:
    """Per-token KL term against log m = ref_logp + log_q, for sampled tokens y ~ pi; grad flows through logp only.

    With d = log m - logp and w = exp(d):
      k1       -d                           expectation: pseudo-KL(pi||m); expected gradient 0 (use it in the reward)
      k2       d^2 / 2                      expected gradient = that of pseudo-KL(pi||m)
      k3       w - d - 1                    the reference implementation; expected gradient = that of KL(m||pi)
      k3+      value of k3, gradient of k2 (straight-through)
      forward  sg(w) * d - sg(w) + 1        value and gradient both of the pseudo-KL(m||pi), importance weighted
      none     0
    Above d = LOG_RATIO_CLIP, exp(d) continues along its tangent. Masked-out entries are exactly 0 and carry no
    gradient.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator={estimator!r} is unknown; choose one of {KL_ESTIMATORS}.")
    log_m = ref_logp if log_q is None else ref_logp + sg(log_q)
    valid = jnp.ones(logp.shape, bool) if mask is None else mask > 0
    d = jnp.where(valid, sg(log_m) - logp, 0.0)
    # Only exp(d) can overflow, and only for large d: cap it there by its tangent (value and gradient stay finite
    # and keep their sign). Large negative d needs no cap: exp(d) -> 0 and the k3 gradient -> 1 pulls pi back to m.
    d_low = jnp.minimum(d, LOG_RATIO_CLIP)
    exp_d = jnp.exp(d_low) * (1.0 + (d - d_low))
    if estimator == "k1":
        value = -d
    elif estimator == "k2":
        value = 0.5 * jnp.square(d)
    elif estimator == "k3":
        value = exp_d - d - 1.0
    elif estimator == "k3+":
        k2 = 0.5 * jnp.square(d)
        value = sg(exp_d - d - 1.0) + (k2 - sg(k2))
    elif estimator == "forward":
        w = sg(jnp.exp(d_low))
        value = w * d - w + 1.0
    else:
        value = jnp.zeros_like(d)
    return jnp.where(valid, value, 0.0)


def kl_reward_penalty(logp_NxC: jax.Array, ref_logp_NxC: jax.Array, log_q_NxC: jax.Array | None,
                      mask_NxC: jax.Array, beta: float) -> jax.Array:
    """Reward adjustment for KL-in-reward (add it to r before the advantages): -beta * sum_t (logp - log m).

    Use the sampler's or the old policy's logprobs; nothing here carries a gradient.
    """
    k1_NxC = kl_term(sg(logp_NxC), sg(ref_logp_NxC), log_q_NxC, "k1", mask_NxC)
    return -beta * k1_NxC.sum(-1)


def forward_kl_coefficients(old_logp_NxC: jax.Array, ref_logp_NxC: jax.Array, log_q_NxC: jax.Array | None,
                            mask_NxC: jax.Array, group_size: int) -> jax.Array:
    """c_i = G * w_i / sum_j w_j - 1 over each group of G completions y_i ~ pi_old, w_i = m(y_i) / pi_old(y_i).

    m(y) = prod_t q_t pi_ref(y_t | y_<t). With these sequence weights, -mean_i c_i grad log pi(y_i) estimates the
    gradient of the forward KL(m~ || pi) over completions, m~ = m normalised (self-normalised importance sampling,
    biased by O(1/G); the -1 is a zero-mean control variate). No gradient.
    """
    check_groups(old_logp_NxC.shape[0], group_size)
    log_m_NxC = ref_logp_NxC if log_q_NxC is None else ref_logp_NxC + log_q_NxC
    log_w_N = jnp.where(mask_NxC > 0, log_m_NxC - old_logp_NxC, 0.0).sum(-1).astype(jnp.float32)
    w_hat_BxG = jax.nn.softmax(log_w_N.reshape(-1, group_size), axis=-1)
    return sg(group_size * w_hat_BxG - 1.0).reshape(-1)


def sequence_forward_kl(logp_NxC: jax.Array, coef_N: jax.Array, mask_NxC: jax.Array) -> jax.Array:
    """Per-token term whose gradient is -c_i grad log pi(y_i,t) (see forward_kl_coefficients).

    Its value is each row's share (c+1) log(c+1) of the group's estimate sum_i w^_i log(G w^_i) of KL(m~ || pi),
    the same on every token of the row. Summed over each row (sequence_forward_kl_loss), never through a per-row
    token mean: that would weigh row i by 1/|y_i| and favour short completions.
    """
    coef_Nx1 = sg(coef_N.astype(jnp.float32))[:, None]
    share_Nx1 = (coef_Nx1 + 1.0) * jnp.log(jnp.maximum(coef_Nx1 + 1.0, 1e-30))
    value_NxC = share_Nx1 - coef_Nx1 * (logp_NxC - sg(logp_NxC))
    return jnp.where(mask_NxC > 0, value_NxC, 0.0)


def sequence_forward_kl_loss(logp_NxC: jax.Array, coef_N: jax.Array, mask_NxC: jax.Array, norm_len: int = 0
                             ) -> jax.Array:
    """mean_i sum_t sequence_forward_kl / L, L = norm_len or C: a constant, whatever loss.aggregation is, so the
    gradient is -(1/(N L)) sum_i c_i grad log pi(y_i), the forward KL's over whole completions (rows of any length)."""
    summed = (sequence_forward_kl(logp_NxC, coef_N, mask_NxC) * mask_NxC).sum(-1)
    return summed.mean() / (norm_len or logp_NxC.shape[-1])


# --------------------------------------------------------------------------------------------------- peers' options

def high_entropy_mask(entropy_NxC: jax.Array, mask_NxC: jax.Array, keep: float) -> jax.Array:
    """float [N, C]: 1 on the real tokens whose entropy is >= the (1 - keep) quantile (linear interpolation, as
    torch.quantile) of all real tokens here, else 0: TRL's top_entropy_quantile = keep."""
    valid_NxC = mask_NxC > 0
    flat = lambda x: x.reshape(1, -1)
    threshold = guides.masked_quantile(flat(sg(entropy_NxC)), flat(mask_NxC), 1.0 - keep)[0]
    return (valid_NxC & (sg(entropy_NxC) >= threshold)).astype(jnp.float32)


def kl_cov_penalty(logp_NxC: jax.Array, old_logp_NxC: jax.Array, adv_N: jax.Array, mask_NxC: jax.Array,
                   ratio: float, coef: float) -> tuple[jax.Array, jax.Array]:
    """(coef * |log pi - log pi_old| on the selected tokens, 0 elsewhere; the selection as float [N, C]).

    Selected: the max(1, floor(ratio * n)) real tokens (n of them) with the largest covariance term
    (A - mean A) * (log pi - mean log pi), means over the real tokens, log pi detached (verl's kl_cov). |d| is
    written d * sign(d) with the sign held fixed, so its gradient is 0 where pi = pi_old (jnp.abs's is 1 there):
    the penalty restrains updates after the first one on a batch and is inert on a single on-policy update.
    """
    valid_NxC = mask_NxC > 0
    n = jnp.maximum(valid_NxC.sum(), 1)
    adv_NxC = jnp.broadcast_to(adv_N[:, None], logp_NxC.shape)
    mean = lambda x: jnp.where(valid_NxC, x, 0.0).sum() / n
    lp_NxC = sg(logp_NxC)
    cov_NxC = jnp.where(valid_NxC, (adv_NxC - mean(adv_NxC)) * (lp_NxC - mean(lp_NxC)), -jnp.inf)
    k = jnp.maximum(jnp.floor(ratio * n).astype(jnp.int32), 1)
    rank = jnp.argsort(jnp.argsort(-cov_NxC.reshape(-1))).reshape(cov_NxC.shape)  # 0 = largest; exactly k picked
    selected_NxC = (valid_NxC & (rank < k)).astype(jnp.float32)
    d_NxC = jnp.where(valid_NxC, logp_NxC - sg(old_logp_NxC), 0.0)
    return coef * selected_NxC * d_NxC * sg(jnp.sign(d_NxC)), selected_NxC


# --------------------------------------------------------------------------------------------------- surrogate

def policy_surrogate(logp_NxC: jax.Array, old_logp_NxC: jax.Array, adv_N: jax.Array, mask_NxC: jax.Array, *,
                     eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float = 0.0,
                     sampler_logp_NxC: jax.Array | None = None, tis_cap: float = 0.0
                     ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO-clip loss per token (clip-higher, optional dual clip and truncated importance sampling) and its stats."""
    valid_NxC = mask_NxC > 0
    adv_Nx1 = adv_N[:, None]
    ratio_NxC = jnp.exp(jnp.where(valid_NxC, logp_NxC - sg(old_logp_NxC), 0.0))
    clipped_NxC = jnp.clip(ratio_NxC, 1.0 - eps_low, 1.0 + eps_high)
    pg_NxC = jnp.maximum(-adv_Nx1 * ratio_NxC, -adv_Nx1 * clipped_NxC)
    if dual_clip:  # caps the loss of negative-advantage tokens whose ratio exploded at dual_clip * |A|
        pg_NxC = jnp.where(adv_Nx1 < 0, jnp.minimum(pg_NxC, -dual_clip * adv_Nx1), pg_NxC)
    if tis_cap:  # corrects the sampler/trainer logprob mismatch
        if sampler_logp_NxC is None:
            raise ValueError("loss.tis_cap > 0 needs batch['sampler_logp'] (the sampler's behaviour logprobs).")
        log_w_NxC = jnp.where(valid_NxC, old_logp_NxC - sampler_logp_NxC, 0.0)
        pg_NxC = pg_NxC * sg(jnp.minimum(jnp.exp(jnp.minimum(log_w_NxC, 30.0)), tis_cap))
    pg_NxC = jnp.where(valid_NxC, pg_NxC, 0.0)
    count = jnp.maximum(valid_NxC.sum(), 1)
    frac = lambda x_NxC: (x_NxC & valid_NxC).sum() / count
    stats = {
        "rl/clip_frac_low": frac((ratio_NxC < 1.0 - eps_low) & (adv_Nx1 < 0)),
        "rl/clip_frac_high": frac((ratio_NxC > 1.0 + eps_high) & (adv_Nx1 > 0)),
        "rl/ratio_mean": jnp.where(valid_NxC, sg(ratio_NxC), 0.0).sum() / count,
    }
    return pg_NxC, stats


def aggregate(loss_NxC: jax.Array, mask_NxC: jax.Array, mode: str, norm_len: int = 0,
              tokens_per_row_N: jax.Array | None = None) -> jax.Array:
    """seq-mean-token-mean (GRPO), token-mean (DAPO / BNPO), seq-mean-token-sum-norm (Dr.GRPO: / norm_len or C).

    token-mean divides by these rows' token count, or by tokens_per_row_N.sum() when given (a micro-batch's share
    of the whole batch's count, see with_batch_normaliser).
    """
    mask_NxC = mask_NxC.astype(loss_NxC.dtype)
    summed_N = (loss_NxC * mask_NxC).sum(-1)
    if mode == "seq-mean-token-mean":
        return (summed_N / jnp.maximum(mask_NxC.sum(-1), 1.0)).mean()
    if mode == "token-mean":
        if tokens_per_row_N is not None:
            return summed_N.sum() / tokens_per_row_N.sum()
        return summed_N.sum() / jnp.maximum(mask_NxC.sum(), 1.0)
    if mode == "seq-mean-token-sum-norm":
        return (summed_N / (norm_len or loss_NxC.shape[-1])).mean()
    raise ValueError(f"loss.aggregation={mode!r} is unknown; choose one of {AGGREGATIONS}.")


# --------------------------------------------------------------------------------------------------- loss

@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Hashable loss settings (pass as a static argument to jit)."""
    kl_estimator: str = "k3"
    beta: float = 0.05
    kl_in_reward: bool = False
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float = 0.0
    tis_cap: float = 0.0  # caps exp(old_logp - sampler_logp); off-policy old_logp IS the sampler's: no effect there
    aggregation: str = "seq-mean-token-mean"
    norm_len: int = 0  # Dr.GRPO's constant divisor (trainer.loss_config: rollout.max_new_tokens); 0 = the width C
    mask_truncated: bool = False
    temperature: float = 1.0
    adv_scale: str = "group"
    adv_eps: float = 1e-4  # with std_ddof 1: the reference trainer's torch.std and epsilon
    std_ddof: int = 1
    adv_estimator: str = "grpo"
    entropy_coef: float = 0.0  # entropy bonus (0 = off)
    top_entropy_quantile: float = 1.0  # share of tokens (highest entropy first) the policy gradient trains on
    kl_cov_ratio: float = 0.0  # share of tokens KL-Cov penalises (0 = off)
    kl_cov_coef: float = 1.0
    guide: guides.GuideConfig = guides.GuideConfig()

    def __post_init__(self):
        if self.kl_estimator not in KL_ESTIMATORS + SEQUENCE_ESTIMATORS:
            raise ValueError(f"loss.kl_estimator={self.kl_estimator!r} is unknown; choose one of "
                             f"{KL_ESTIMATORS + SEQUENCE_ESTIMATORS}.")
        if self.kl_in_reward and self.kl_estimator in SEQUENCE_ESTIMATORS:
            raise ValueError(f"loss.kl_estimator={self.kl_estimator!r} is a loss term: set loss.kl_in_reward=False.")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"loss.aggregation={self.aggregation!r} is unknown; choose one of {AGGREGATIONS}.")
        if self.adv_scale not in ADV_SCALES:
            raise ValueError(f"loss.adv_scale={self.adv_scale!r} is unknown; choose one of {ADV_SCALES}.")
        if self.adv_estimator not in ADV_ESTIMATORS:
            raise ValueError(f"loss.adv_estimator={self.adv_estimator!r} is unknown; choose one of {ADV_ESTIMATORS}.")
        if self.dual_clip and self.dual_clip <= 1.0:
            raise ValueError(f"loss.dual_clip={self.dual_clip} must be 0 (off) or > 1 (e.g. 3.0).")
        if self.eps_low < 0 or self.eps_high < 0 or self.tis_cap < 0 or self.beta < 0:
            raise ValueError("loss.eps_low, loss.eps_high, loss.tis_cap and loss.beta must be >= 0.")
        if self.temperature <= 0:
            raise ValueError(f"loss.temperature={self.temperature} must be > 0.")
        if not 0.0 <= self.top_entropy_quantile <= 1.0 or not 0.0 <= self.kl_cov_ratio <= 1.0:
            raise ValueError("loss.top_entropy_quantile and loss.kl_cov_ratio must lie in [0, 1] (e.g. 0.2, 0.002).")
        if self.entropy_coef < 0 or self.kl_cov_coef < 0:
            raise ValueError("loss.entropy_coef and loss.kl_cov_coef must be >= 0.")

    @property
    def kl_in_loss(self) -> bool:
        return not self.kl_in_reward and self.kl_estimator != "none" and self.beta > 0

    @classmethod
    def from_config(cls, loss_cfg: Mapping[str, Any], total_steps: int | None = None) -> "LossConfig":
        """Builds from `config.loss` (ConfigDict / dict); absent fields keep the defaults above."""
        values = {f.name: loss_cfg[f.name] for f in dataclasses.fields(cls) if f.name != "guide" and f.name in loss_cfg}
        return cls(guide=guides.GuideConfig.from_config(loss_cfg, total_steps), **values)


# Set by the trainer from other sections (rollout.temperature, train.steps), so not config.loss keys.
_DERIVED = ("guide", "temperature", "schedule_steps")


def loss_defaults() -> dict[str, Any]:
    """config.loss's keys and defaults (configs/base.py): LossConfig's and GuideConfig's fields, in one flat dict."""
    fields = [*dataclasses.fields(LossConfig), *dataclasses.fields(guides.GuideConfig)]
    defaults = {**dataclasses.asdict(LossConfig()), **dataclasses.asdict(guides.GuideConfig())}
    return {guides.config_key(f.name): defaults[f.name] for f in fields if f.name not in _DERIVED}


def sampled_tokens(batch: Mapping[str, jax.Array]) -> jax.Array:
    """float [N, C]: the completion tokens the policy drew. A multi-turn row's `sampled_mask` is 0 on its observed
    tokens (tool output: context for attention, never trained); this is the one mask of every term and metric."""
    mask_NxC = batch["completion_mask"].astype(jnp.float32)
    if batch.get("sampled_mask") is not None:
        mask_NxC = mask_NxC * batch["sampled_mask"].astype(jnp.float32)
    return mask_NxC


def loss_mask(batch: Mapping[str, jax.Array], loss_cfg: LossConfig) -> jax.Array:
    """float [N, C]: the sampled tokens the loss counts (truncated rows dropped under mask_truncated)."""
    mask_NxC = sampled_tokens(batch)
    if loss_cfg.mask_truncated and "truncated" in batch:
        mask_NxC = mask_NxC * (1.0 - batch["truncated"].astype(jnp.float32))[:, None]
    return mask_NxC


def with_batch_normaliser(batch: Mapping[str, jax.Array], loss_cfg: LossConfig) -> dict[str, jax.Array]:
    """The batch plus `tokens_per_row` [N] (its token count / N) for token-mean, so that micro-batches split from it
    divide by the whole batch's token count rather than each by its own."""
    if loss_cfg.aggregation != "token-mean":
        return dict(batch)
    mask_NxC = loss_mask(batch, loss_cfg)
    rows = mask_NxC.shape[:-1]  # [N], or [S, n] in packing's layout
    n = math.prod(rows)
    return {**batch, "tokens_per_row": jnp.full(rows, jnp.maximum(mask_NxC.sum(), 1.0) / n, jnp.float32)}


def loss_from_logprobs(logp_NxC: jax.Array, entropy_NxC: jax.Array, batch: Mapping[str, jax.Array],
                       loss_cfg: LossConfig, step: jax.Array | int = 0, key: jax.Array | None = None
                       ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The loss given the policy's completion logprobs/entropies (everything in loss_fn after the model)."""
    mask_NxC = loss_mask(batch, loss_cfg)
    adv_N = batch["advantages"].astype(jnp.float32)
    old_logp_NxC = batch["old_logp"] if batch.get("old_logp") is not None else sg(logp_NxC)
    ref_logp_NxC = batch["ref_logp"]

    log_q_NxC = guides.compute_log_q(loss_cfg.guide.name, logp_NxC, entropy_NxC, mask_NxC, key, loss_cfg.guide, step)
    pg_NxC, pg_stats = policy_surrogate(
        logp_NxC, old_logp_NxC, adv_N, mask_NxC, eps_low=loss_cfg.eps_low, eps_high=loss_cfg.eps_high,
        dual_clip=loss_cfg.dual_clip, sampler_logp_NxC=batch.get("sampler_logp"), tis_cap=loss_cfg.tis_cap)
    pg_share_NxC = mask_NxC
    if loss_cfg.top_entropy_quantile < 1.0:
        pg_share_NxC = high_entropy_mask(entropy_NxC, mask_NxC, loss_cfg.top_entropy_quantile)
        pg_NxC = pg_NxC * pg_share_NxC
    cov_NxC, cov_selected_NxC = jnp.zeros_like(pg_NxC), jnp.zeros_like(pg_NxC)
    if loss_cfg.kl_cov_ratio > 0:
        cov_NxC, cov_selected_NxC = kl_cov_penalty(logp_NxC, old_logp_NxC, adv_N, mask_NxC, loss_cfg.kl_cov_ratio,
                                                   loss_cfg.kl_cov_coef)
    bonus_NxC = -loss_cfg.entropy_coef * entropy_NxC if loss_cfg.entropy_coef else jnp.zeros_like(pg_NxC)
    kl_seq = 0.0  # forward-seq: over whole completions, outside the per-token aggregation
    if loss_cfg.kl_in_loss and loss_cfg.kl_estimator in SEQUENCE_ESTIMATORS:
        if batch.get("seq_kl_coef") is None:
            raise ValueError(f"loss.kl_estimator={loss_cfg.kl_estimator!r} needs batch['seq_kl_coef'] "
                             "(objectives.forward_kl_coefficients over each group; trainer.rl_step adds it).")
        kl_seq = loss_cfg.beta * sequence_forward_kl_loss(logp_NxC, batch["seq_kl_coef"], mask_NxC,
                                                          loss_cfg.norm_len)
        kl_NxC = jnp.zeros_like(pg_NxC)
    elif loss_cfg.kl_in_loss:
        kl_NxC = loss_cfg.beta * kl_term(logp_NxC, ref_logp_NxC, log_q_NxC, loss_cfg.kl_estimator, mask_NxC)
    else:
        kl_NxC = jnp.zeros_like(pg_NxC)
    agg = lambda x_NxC: aggregate(x_NxC, mask_NxC, loss_cfg.aggregation, loss_cfg.norm_len,
                                  batch.get("tokens_per_row"))
    loss = agg(pg_NxC + kl_NxC + cov_NxC + bonus_NxC) + kl_seq
    for name in ("sampler_logp", "old_logp"):  # NaN marks observed tokens: on a trained one the step's check fails
        if batch.get(name) is not None:
            loss = jnp.where(jnp.any(jnp.isnan(batch[name]) & (mask_NxC > 0)), jnp.nan, loss)

    count = jnp.maximum(mask_NxC.sum(), 1.0)
    token_mean = lambda x_NxC: (sg(x_NxC) * mask_NxC).sum() / count
    metrics = {
        "loss/total": loss,
        "loss/policy": agg(sg(pg_NxC)),
        "loss/kl": agg(sg(kl_NxC)) + sg(kl_seq),
        "loss/kl_cov": agg(sg(cov_NxC)),
        "loss/entropy_bonus": agg(sg(bonus_NxC)),
        # k3 is the one estimator that is non-negative per token, so it is what every arm logs
        "rl/kl": token_mean(kl_term(logp_NxC, ref_logp_NxC, log_q_NxC, "k3", mask_NxC)),
        "rl/kl_ref": token_mean(kl_term(logp_NxC, ref_logp_NxC, None, "k3", mask_NxC)),
        "rl/entropy": token_mean(entropy_NxC),
        "rl/adv_mean": adv_N.mean(),
        "rl/adv_std": adv_N.std(),
        "rl/adv_max": adv_N.max(),
        "rl/adv_min": adv_N.min(),
        "rl/response_len": sampled_tokens(batch).sum(-1).mean(),
        "rl/pg_token_frac": token_mean(pg_share_NxC),  # share of tokens the policy gradient trains on
        "rl/kl_cov_frac": token_mean(cov_selected_NxC),
        **pg_stats,
        **guides.q_stats(log_q_NxC, mask_NxC),
    }
    return loss, metrics


def loss_fn(params: Any, batch: Mapping[str, jax.Array], model_cfg: model_lib.ModelConfig, loss_cfg: LossConfig,
            step: jax.Array | int = 0, key: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Policy forward over prompt+completion, then loss_from_logprobs. model_cfg and loss_cfg are static under jit.

    Completion token j of row n is tokens[n, P+j], predicted at position P+j-1: targets are the tokens shifted left
    and the logprobs start at P-1. `key` seeds the random/token guides (fold the step in before calling).
    """
    tokens_NxT = batch["tokens"]
    num_completion = batch["completion_mask"].shape[1]
    prompt_len = tokens_NxT.shape[1] - num_completion
    if prompt_len < 1:
        raise ValueError(f"tokens [N, {tokens_NxT.shape[1]}] leave no prompt before the {num_completion} completion "
                         "columns: each row needs at least one prompt token.")
    pad_Nx1 = jnp.full((tokens_NxT.shape[0], 1), model_cfg.pad_token_id, tokens_NxT.dtype)
    targets_NxT = jnp.concatenate([tokens_NxT[:, 1:], pad_Nx1], axis=1)
    logp_NxC, entropy_NxC = model_lib.logprobs_and_entropy(
        model_cfg, params, tokens_NxT, targets_NxT, mask_BxT=batch.get("mask"), temperature=loss_cfg.temperature,
        start=prompt_len - 1, length=num_completion)
    return loss_from_logprobs(logp_NxC, entropy_NxC, batch, loss_cfg, step, key)
