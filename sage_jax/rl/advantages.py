"""Group-relative advantages: each prompt's G rollouts are consecutive rows, compared with each other."""

from __future__ import annotations

import jax
import jax.numpy as jnp

ADV_SCALES = ("group", "batch", "none")
ADV_ESTIMATORS = ("grpo", "rloo")


def check_groups(n: int, group_size: int) -> None:
    if group_size < 1 or n % group_size:
        raise ValueError(f"{n} rewards do not split into groups of {group_size}: rewards must be [num_prompts * G], "
                         "each group's G rollouts consecutive.")


def zero_variance_groups(rewards_N: jax.Array, group_size: int) -> jax.Array:
    """bool[B]: groups whose rewards are all equal (no learning signal; DAPO's dynamic sampling drops them)."""
    rewards_N = jnp.asarray(rewards_N, jnp.float32)
    check_groups(rewards_N.shape[0], group_size)
    r_BxG = rewards_N.reshape(-1, group_size)
    return r_BxG.max(-1) == r_BxG.min(-1)


def group_advantages(rewards_N: jax.Array, group_size: int, *, scale: str = "group", eps: float = 1e-6,
                     ddof: int = 0, estimator: str = "grpo") -> jax.Array:
    """(r - baseline) / (std + eps) per consecutive group of `group_size`; exactly 0 for zero-variance groups.

    estimator "grpo": baseline = group mean; "rloo": baseline = mean of the other G-1 rollouts.
    scale "group": per-group std; "batch": std over all rewards; "none": no division (Dr.GRPO).
    """
    if scale not in ADV_SCALES:
        raise ValueError(f"adv_scale={scale!r} is unknown; choose one of {ADV_SCALES}.")
    if estimator not in ADV_ESTIMATORS:
        raise ValueError(f"adv_estimator={estimator!r} is unknown; choose one of {ADV_ESTIMATORS}.")
    if estimator == "rloo" and group_size < 2:
        raise ValueError("adv_estimator='rloo' needs at least 2 rollouts per prompt (group_size >= 2).")
    rewards_N = jnp.asarray(rewards_N, jnp.float32)
    n = rewards_N.shape[0]
    check_groups(n, group_size)
    r_BxG = rewards_N.reshape(-1, group_size)
    centered_BxG = r_BxG - r_BxG.mean(-1, keepdims=True)
    if estimator == "rloo":  # r_i - mean_{j != i} r_j = G/(G-1) * (r_i - mean)
        centered_BxG = centered_BxG * (group_size / (group_size - 1))
    if scale == "group":
        var_Bx1 = (jnp.square(r_BxG - r_BxG.mean(-1, keepdims=True)).sum(-1, keepdims=True)
                   / max(group_size - ddof, 1))
        adv_BxG = centered_BxG / (jnp.sqrt(var_Bx1) + eps)
    elif scale == "batch":
        var = jnp.square(rewards_N - rewards_N.mean()).sum() / max(n - ddof, 1)
        adv_BxG = centered_BxG / (jnp.sqrt(var) + eps)
    else:
        adv_BxG = centered_BxG
    adv_BxG = jnp.where(zero_variance_groups(rewards_N, group_size)[:, None], 0.0, adv_BxG)
    return adv_BxG.reshape(n)
