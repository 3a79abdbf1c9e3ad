"""Completion-length workloads for the benchmarks, the same for every side compared.

`fixed`: every row runs to the maximum. `longtail`: RLVR-like lengths -- most completions stop after a fraction of
the budget and a few run to it -- pre-drawn once and forced on each side (`longtail_lengths`), so both do the same
work whatever their samplers pick. Only tokens before an EOS count as generated tokens; `length_quantiles`
summarises what a side actually produced.
"""

from __future__ import annotations

import math

import numpy as np

WORKLOADS = ("fixed", "longtail")


def longtail_lengths(rows: int, max_new_tokens: int, seed: int = 0, median_frac: float = 0.2,
                     min_at_max: float = 0.02) -> np.ndarray:
    """int32 [rows] lengths in [1, max_new_tokens]: an exponential law with median median_frac * max_new_tokens,
    capped at the max (for 0.2, 2^-5 = 3.1% of its mass sits at the cap), and at least ceil(min_at_max * rows)
    rows at the max. The values are the law's quantiles at (i + 0.5) / rows, not random draws, so every run and
    every side sees the same multiset; the seed only shuffles which row gets which length."""
    if rows < 1 or max_new_tokens < 1 or not 0 < median_frac <= 1 or not 0 <= min_at_max <= 1:
        raise ValueError(f"longtail_lengths(rows={rows}, max_new_tokens={max_new_tokens}, median_frac={median_frac}, "
                         f"min_at_max={min_at_max}): need rows, max_new_tokens >= 1, 0 < median_frac <= 1, "
                         "0 <= min_at_max <= 1")
    quantile_R = (np.arange(rows) + 0.5) / rows
    scale = median_frac * max_new_tokens / math.log(2)
    lengths_R = np.clip(np.ceil(-scale * np.log1p(-quantile_R)), 1, max_new_tokens).astype(np.int32)
    at_max = math.ceil(min_at_max * rows)
    if at_max:
        lengths_R[rows - at_max:] = max_new_tokens  # the quantiles ascend: the longest rows are last
    return np.random.default_rng(seed).permutation(lengths_R)


def workload_lengths(workload: str, rows: int, max_new_tokens: int, seed: int = 0) -> np.ndarray:
    """int32 [rows] forced completion lengths for a workload name in WORKLOADS."""
    if workload == "fixed":
        return np.full(rows, max_new_tokens, np.int32)
    if workload == "longtail":
        return longtail_lengths(rows, max_new_tokens, seed)
    raise ValueError(f"unknown workload {workload!r}; choose one of {list(WORKLOADS)}")


def length_quantiles(lengths, max_new_tokens: int) -> dict[str, float]:
    """Realised completion lengths -> {len_p10, len_p50, len_p90, len_max, len_mean, frac_at_max, tokens}."""
    lengths = np.asarray(lengths)
    p10, p50, p90 = np.percentile(lengths, [10, 50, 90])
    return dict(len_p10=float(p10), len_p50=float(p50), len_p90=float(p90), len_max=int(lengths.max()),
                len_mean=float(lengths.mean()), frac_at_max=float(np.mean(lengths >= max_new_tokens)),
                tokens=int(lengths.sum()))


def tokens_before_eos(completions_NxC: np.ndarray, eos_ids) -> np.ndarray:
    """int [N]: per row, the tokens before its first EOS id (all C when it has none)."""
    hit_NxC = np.isin(completions_NxC, np.asarray(list(eos_ids), dtype=completions_NxC.dtype))
    return np.where(hit_NxC.any(axis=1), hit_NxC.argmax(axis=1), completions_NxC.shape[1])
