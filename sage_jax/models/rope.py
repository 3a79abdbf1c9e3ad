"""Rotary position embeddings: the frequencies of each HF rope_type, and their rotation of queries and keys.

The frequencies depend only on the config, so they are computed on the host (numpy) and enter the traced program as
constants.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def frequencies(head_dim: int, theta: float, scaling: dict[str, Any], max_positions: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies [head_dim / 2], cos/sin scale), following HF's rope_type conventions.

    `scaling` is HF's rope_parameters without rope_theta ({} or rope_type "default": plain RoPE).

    "linear" divides every frequency by `factor`; "llama3" divides only the low frequencies (wavelengths above
    original_max_position_embeddings / low_freq_factor), keeps the high ones and blends in between; "yarn" blends
    interpolated and extrapolated frequencies by a ramp over the dimensions and scales cos/sin by attention_factor.
    """
    hd, p = head_dim, scaling
    inv_freq = (1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd)).astype(np.float32)
    kind = p.get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    factor = float(p["factor"])
    original = int(p.get("original_max_position_embeddings") or max_positions)
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original / high) & (wavelen <= original / low)
        return np.where(medium, blended, scaled).astype(np.float32), 1.0
    if kind == "yarn":
        mscale = lambda m: 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0
        attention_factor = p.get("attention_factor") or (
            mscale(p["mscale"]) / mscale(p["mscale_all_dim"]) if p.get("mscale") and p.get("mscale_all_dim")
            else mscale(1.0))
        beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)
        # the dimension at which a wavelength makes `rotations` turns over the original context
        dim_of = lambda rotations: hd * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        lo, hi = dim_of(beta_fast), dim_of(beta_slow)
        if p.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, hd - 1)
        ramp = np.clip((np.arange(hd // 2, dtype=np.float32) - lo) / ((hi - lo) or 0.001), 0, 1)
        inv = (inv_freq / factor) * ramp + inv_freq * (1 - ramp)
        return inv.astype(np.float32), float(attention_factor)
    raise ValueError(f"rope_type={kind!r} is not implemented; use 'default', 'linear', 'llama3' or 'yarn'")


def apply(x_BxTxNxH: jax.Array, positions_BxT: jax.Array, inv_freq: np.ndarray, scale: float = 1.0) -> jax.Array:
    angles = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B,T,hd/2]
    cos = (jnp.cos(angles) * scale)[:, :, None, :]
    sin = (jnp.sin(angles) * scale)[:, :, None, :]
    x1, x2 = jnp.split(x_BxTxNxH.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxNxH.dtype)
