"""Guide functions q for the SAGE anchor m = q * pi_ref.

Every guide returns log q per completion token, carries no gradient, is 1 (log q = 0) on padding and is clamped to
[q_min, q_max]. Guides: "none" (q = 1), "random", "token" (surprisal) and "branch" (entropy).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp

GUIDES = ("none", "random", "token", "branch")
TOKEN_NORMS = ("minmax", "rank", "zsigmoid")


@dataclasses.dataclass(frozen=True)
class GuideConfig:
    """Hashable guide settings (the `_end` values are where the cosine-cycle schedules finish)."""
    name: str = "none"
    q_min: float = 0.6
    q_max: float = 1.4
    gamma: float = 0.3
    tau: float = 1.2
    random_eps: float = 0.1
    random_eps_end: float = 0.0
    random_std: float = 0.15
    random_std_end: float = 0.05
    token_alpha: float = 0.3
    token_alpha_end: float = 0.1
    token_sigma: float = 0.25
    token_sigma_end: float = 0.1
    token_norm: str = "minmax"
    token_quantiles: tuple[float, float] = (0.05, 0.95)
    schedule_steps: int = 1000
    schedule_cycles: int = 8
    schedule_decay: float = 0.9

    def __post_init__(self):
        if self.name not in GUIDES:
            raise ValueError(f"loss.guide={self.name!r} is not a guide; choose one of {GUIDES}.")
        if self.token_norm not in TOKEN_NORMS:
            raise ValueError(f"loss.token_norm={self.token_norm!r} is unknown; choose one of {TOKEN_NORMS}.")
        if not 0.0 < self.q_min <= 1.0 <= self.q_max:
            raise ValueError(f"need 0 < loss.q_min <= 1 <= loss.q_max, got q_min={self.q_min}, q_max={self.q_max}.")
        lo, hi = self.token_quantiles
        if not 0.0 <= lo < hi <= 1.0:
            raise ValueError(f"loss.token_quantiles must satisfy 0 <= lo < hi <= 1, got {self.token_quantiles}.")
        if self.schedule_steps < 1 or self.schedule_cycles < 1:
            raise ValueError("loss.schedule_steps and loss.schedule_cycles must be >= 1.")

    @classmethod
    def from_config(cls, loss_cfg: Mapping[str, Any], total_steps: int | None = None) -> "GuideConfig":
        """Reads the guide fields of `config.loss` (a ConfigDict or dict; its key for `name` is "guide"); absent
        fields keep the defaults above, schedule_steps defaults to total_steps."""
        values = {}
        for field in dataclasses.fields(cls):
            key = config_key(field.name)
            if key in loss_cfg:
                value = loss_cfg[key]
                values[field.name] = tuple(value) if field.name == "token_quantiles" else value
        if "schedule_steps" not in values and total_steps is not None:
            values["schedule_steps"] = int(total_steps)
        return cls(**values)


def config_key(field_name: str) -> str:
    """The config.loss key of a GuideConfig field."""
    return "guide" if field_name == "name" else field_name


def cosine_cycle_schedule(start: float, end: float, step: jax.Array | int, total_steps: int, cycles: int = 8,
                          decay: float = 0.9) -> jax.Array:
    """Cosine from the cycle's upper bound down to end in each of `cycles` equal cycles; cycle c starts at
    start * decay**c (the reference trainer shrinks the upper bound, not only the gap above the floor).

    Reaches `end` at the close of every cycle and stays there from step >= total_steps on.
    """
    step = jnp.asarray(step, jnp.float32)
    cycle_len = total_steps / cycles
    cycle = jnp.clip(jnp.floor(step / cycle_len), 0, cycles - 1)
    phase = jnp.clip((step - cycle * cycle_len) / cycle_len, 0.0, 1.0)
    amplitude = start * jnp.power(decay, cycle) - end
    return (end + amplitude * 0.5 * (1.0 + jnp.cos(math.pi * phase))).astype(jnp.float32)


def _schedule(guide: GuideConfig, name: str, step) -> jax.Array:
    return cosine_cycle_schedule(getattr(guide, name), getattr(guide, name + "_end"), step, guide.schedule_steps,
                                 guide.schedule_cycles, guide.schedule_decay)


def masked_quantile(x_NxC: jax.Array, mask_NxC: jax.Array, quantile: float) -> jax.Array:
    """Per-row quantile (linear interpolation) over the masked entries; 0 for rows without any."""
    valid_NxC = mask_NxC > 0
    sorted_NxC = jnp.sort(jnp.where(valid_NxC, x_NxC, jnp.inf), axis=-1)
    count_N = valid_NxC.sum(-1)
    pos_N = quantile * jnp.maximum(count_N - 1, 0).astype(jnp.float32)
    lo_N = jnp.floor(pos_N).astype(jnp.int32)
    hi_N = jnp.minimum(lo_N + 1, jnp.maximum(count_N - 1, 0))
    take = lambda idx_N: jnp.take_along_axis(sorted_NxC, idx_N[:, None], axis=-1)[:, 0]
    frac_N = pos_N - lo_N
    value_N = (1.0 - frac_N) * take(lo_N) + frac_N * take(hi_N)
    return jnp.where(count_N > 0, value_N, 0.0)


def normalize_per_sequence(x_NxC: jax.Array, mask_NxC: jax.Array, method: str = "minmax",
                           quantiles: tuple[float, float] = (0.05, 0.95), eps: float = 1e-6) -> jax.Array:
    """Maps each row's masked values to w in [0, 1]; 0 on padding and on rows with no spread."""
    valid_NxC = mask_NxC > 0
    count_N = valid_NxC.sum(-1, keepdims=True)
    if method == "minmax":
        lo_N1 = masked_quantile(x_NxC, mask_NxC, quantiles[0])[:, None]
        hi_N1 = masked_quantile(x_NxC, mask_NxC, quantiles[1])[:, None]
        span_N1 = hi_N1 - lo_N1
        w_NxC = jnp.where(span_N1 > eps, jnp.clip((x_NxC - lo_N1) / jnp.maximum(span_N1, eps), 0.0, 1.0), 0.0)
    elif method == "rank":
        sorted_NxC = jnp.sort(jnp.where(valid_NxC, x_NxC, jnp.inf), axis=-1)
        search = jax.vmap(lambda row, v, side: jnp.searchsorted(row, v, side=side), in_axes=(0, 0, None))
        left_NxC = search(sorted_NxC, x_NxC, "left")
        right_NxC = search(sorted_NxC, x_NxC, "right")
        rank_NxC = 0.5 * (left_NxC + right_NxC - 1).astype(jnp.float32)  # ties share their average rank
        w_NxC = rank_NxC / jnp.maximum(count_N - 1, 1).astype(jnp.float32)
    elif method == "zsigmoid":
        n_N1 = jnp.maximum(count_N, 1).astype(jnp.float32)
        mean_N1 = jnp.where(valid_NxC, x_NxC, 0.0).sum(-1, keepdims=True) / n_N1
        var_N1 = jnp.where(valid_NxC, (x_NxC - mean_N1) ** 2, 0.0).sum(-1, keepdims=True) / n_N1
        w_NxC = jax.nn.sigmoid((x_NxC - mean_N1) / (jnp.sqrt(var_N1) + eps))
    else:
        raise ValueError(f"token normalisation {method!r} is unknown; choose one of {TOKEN_NORMS}.")
    return jnp.where(valid_NxC, w_NxC, 0.0)


def compute_q(name: str, logp_NxC: jax.Array, entropy_NxC: jax.Array, mask_NxC: jax.Array,
              key: jax.Array | None, params: GuideConfig, step: jax.Array | int = 0) -> jax.Array:
    """q per completion token (no gradient, 1 on padding, clamped to [q_min, q_max])."""
    if name not in GUIDES:
        raise ValueError(f"guide {name!r} is unknown; choose one of {GUIDES}.")
    logp_NxC = jax.lax.stop_gradient(logp_NxC)
    entropy_NxC = jax.lax.stop_gradient(entropy_NxC)
    valid_NxC = mask_NxC > 0
    if name in ("random", "token") and key is None:
        raise ValueError(f"the {name!r} guide draws noise: pass a jax.random key.")
    if name == "none":
        q_NxC = jnp.ones_like(logp_NxC)
    elif name == "random":
        flip_key, noise_key = jax.random.split(key)
        eps, std = _schedule(params, "random_eps", step), _schedule(params, "random_std", step)
        perturbed_NxC = jax.random.uniform(flip_key, logp_NxC.shape) < eps
        q_NxC = jnp.where(perturbed_NxC, 1.0 + std * jax.random.normal(noise_key, logp_NxC.shape), 1.0)
    elif name == "token":
        w_NxC = normalize_per_sequence(-logp_NxC, mask_NxC, params.token_norm,
                                       params.token_quantiles)
        alpha, sigma = _schedule(params, "token_alpha", step), _schedule(params, "token_sigma", step)
        q_NxC = 1.0 + alpha * w_NxC + sigma * w_NxC * jax.random.normal(key, logp_NxC.shape)
    else:  # branch: lift the anchor where the current policy is uncertain
        q_NxC = 1.0 + params.gamma * jax.nn.relu(entropy_NxC - params.tau)
    q_NxC = jnp.clip(q_NxC, params.q_min, params.q_max)
    return jax.lax.stop_gradient(jnp.where(valid_NxC, q_NxC, 1.0).astype(jnp.float32))


def compute_log_q(name: str, logp_NxC: jax.Array, entropy_NxC: jax.Array, mask_NxC: jax.Array,
                  key: jax.Array | None, params: GuideConfig, step: jax.Array | int = 0) -> jax.Array:
    """log q per completion token; exactly 0 on padding and for the "none" guide."""
    return jnp.log(compute_q(name, logp_NxC, entropy_NxC, mask_NxC, key, params, step))


def q_stats(log_q_NxC: jax.Array, mask_NxC: jax.Array) -> dict[str, jax.Array]:
    """sage/q_{mean,min,max,p90,frac_above_1,active} over real tokens (1.0 / 0.0 when there are none).

    q_active is the share of tokens with q != 1 (either side), q_p90 the 90th percentile of q over the batch's tokens.
    """
    valid_NxC = mask_NxC > 0
    q_NxC = jnp.exp(log_q_NxC)
    count = jnp.maximum(valid_NxC.sum(), 1)
    has_any = valid_NxC.any()
    p90 = masked_quantile(q_NxC.reshape(1, -1), mask_NxC.reshape(1, -1), 0.9)[0]
    return {
        "sage/q_p90": jnp.where(has_any, p90, 1.0),
        "sage/q_active": (valid_NxC & (jnp.abs(log_q_NxC) > 1e-6)).sum() / count,
        "sage/q_mean": jnp.where(valid_NxC, q_NxC, 0.0).sum() / count + jnp.where(has_any, 0.0, 1.0),
        "sage/q_min": jnp.where(has_any, jnp.where(valid_NxC, q_NxC, jnp.inf).min(), 1.0),
        "sage/q_max": jnp.where(has_any, jnp.where(valid_NxC, q_NxC, -jnp.inf).max(), 1.0),
        "sage/q_frac_above_1": (valid_NxC & (log_q_NxC > 1e-6)).sum() / count,
    }
