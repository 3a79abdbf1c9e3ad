"""Statistics over runs: mean and 95% t-interval over seeds, and a run's scalar summary from its raw counts."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Mapping, Sequence

import numpy as np

from sage_jax import evaluation
from sage_jax.rewards import countdown

# two-sided 95% Student t quantiles t_{0.975, df}
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000, 120: 1.980}


def t_quantile_975(df: int) -> float:
    """t_{0.975, df}; between table entries the next smaller df's (wider, so conservative)."""
    if df < 1:
        raise ValueError(f"a t-interval needs at least 2 values (df >= 1), got df={df}")
    return _T975[max(d for d in _T975 if d <= df)] if df <= 120 else 1.960


def mean_ci(values: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% t-interval: t_{0.975, n-1} * s / sqrt(n), s with ddof 1); NaN half for n < 2."""
    x = np.asarray([v for v in values if v is not None], np.float64)
    if x.size == 0:
        return math.nan, math.nan
    if x.size < 2:
        return float(x[0]), math.nan
    return float(x.mean()), float(t_quantile_975(x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))


def fmt(mean: float, half: float = math.nan, digits: int = 3) -> str:
    if mean is None or math.isnan(mean):
        return "–"
    return f"{mean:.{digits}f}" if math.isnan(half) else f"{mean:.{digits}f} ± {half:.{digits}f}"


def pass_curve(problem_stats: Sequence[Mapping[str, Any]]) -> list[float]:
    """Mean unbiased pass@k over problems for k = 1..n."""
    n = int(problem_stats[0]["n"])
    correct_P = [int(s["correct"]) for s in problem_stats]
    return [float(evaluation.pass_at_k_array(n, correct_P, k).mean()) for k in range(1, n + 1)]


def strategy_counts(problem_stats: Sequence[Mapping[str, Any]]) -> Counter:
    return sum((Counter(s["strategies"]) for s in problem_stats), Counter())


def shares(counts: Mapping[str, int]) -> dict[str, float]:
    total = sum(counts.values())
    return {s: (counts.get(s, 0) / total if total else math.nan) for s in countdown.STRATEGIES}


def _tail_mean(values: Sequence[float | None], frac: float) -> float:
    x = [v for v in values if v is not None]
    if not x:
        return math.nan
    return float(np.mean(x[-max(1, int(round(len(x) * frac))):]))


def summarize_run(record: Mapping[str, Any]) -> dict[str, Any]:
    """Scalars (and pass@k curves) of one evaluated policy; record["eval"] maps split -> problem_stats list."""
    out: dict[str, Any] = {}
    for split, problem_stats in record["eval"].items():
        curve = pass_curve(problem_stats)
        out[f"{split}/curve"] = curve
        for k in range(1, len(curve) + 1):
            out[f"{split}/pass@{k}"] = curve[k - 1]
        out[f"{split}/distinct"] = float(np.mean([s["distinct"] for s in problem_stats]))
        out[f"{split}/coverage"] = float(np.mean([s["distinct"] / s["solutions"] for s in problem_stats]))
        for s, v in shares(strategy_counts(problem_stats)).items():
            out[f"{split}/share/{s}"] = v
    curves = record.get("curves") or {}
    for name in ("entropy", "reward", "kl_ref"):
        if curves.get(name):
            out[f"train/{name}_start"] = _tail_mean(curves[name][:max(1, len(curves[name]) // 10)], 1.0)
            out[f"train/{name}_end"] = _tail_mean(curves[name], 0.1)
    return out


def aggregate(summaries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Over seeds: key -> (mean, half) for scalars; "<split>/curve" -> (mean_K, half_K) lists."""
    out: dict[str, Any] = {}
    for key in summaries[0]:
        values = [s.get(key) for s in summaries]
        if key.endswith("/curve"):
            pairs = [mean_ci(col) for col in zip(*values)]
            out[key] = ([p[0] for p in pairs], [p[1] for p in pairs])
        else:
            out[key] = mean_ci([v for v in values if v is not None and not math.isnan(v)])
    return out


def paired_difference(a: Mapping[int, Mapping[str, Any]], b: Mapping[int, Mapping[str, Any]], key: str
                      ) -> tuple[float, float, int]:
    """a - b on key over the seeds both ran (same seed = same RL sampling noise): mean, 95% t half-width, count."""
    diffs = [a[s][key] - b[s][key] for s in sorted(set(a) & set(b)) if key in a[s] and key in b[s]]
    return (*mean_ci(diffs), len(diffs))
