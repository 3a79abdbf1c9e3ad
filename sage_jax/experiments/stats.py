"""Statistics over runs: mean and 95% t-interval over seeds, the pass@k curve from raw counts, paired
t-tests with Holm's correction and the minimum detectable effect."""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from sage_jax.eval import passk as evaluation

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
    diffs = paired_diffs(a, b, key)
    return (*mean_ci(diffs), len(diffs))


# --------------------------------------------------------------------------------------------------- tests, power

def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b) by its continued fraction (modified Lentz), for the t distribution."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    if x > (a + 1.0) / (a + b + 2.0):  # the fraction converges fast on this side only
        return 1.0 - _betainc(b, a, 1.0 - x)
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 300):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-14:
            break
    return math.exp(log_front) * f / a


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with df degrees of freedom."""
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_ppf(p: float, df: int) -> float:
    """The p-quantile of Student's t (bisection on t_cdf)."""
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return 0.5 * (lo + hi)


def paired_test(diffs: Sequence[float]) -> dict[str, float]:
    """Paired t-test of mean(diffs) = 0: mean, 95% half-width (as mean_ci), sd, n, two-sided p, and the minimum
    detectable effect at 80% power and alpha 0.05, (t_{0.975, n-1} + t_{0.8, n-1}) * sd / sqrt(n)."""
    x = np.asarray(diffs, np.float64)
    n = int(x.size)
    mean, half = mean_ci(x.tolist())
    if n < 2:
        return {"mean": mean, "half": half, "sd": math.nan, "n": n, "p": math.nan, "mde": math.nan}
    sd = float(x.std(ddof=1))
    se = sd / math.sqrt(n)
    p = 1.0 if se == 0 and mean == 0 else 0.0 if se == 0 else 2.0 * (1.0 - t_cdf(abs(mean) / se, n - 1))
    mde = (t_ppf(0.975, n - 1) + t_ppf(0.8, n - 1)) * se
    return {"mean": mean, "half": half, "sd": sd, "n": n, "p": p, "mde": mde}


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values (NaN entries stay NaN and do not count as comparisons)."""
    idx = [i for i, p in enumerate(p_values) if not math.isnan(p)]
    order = sorted(idx, key=lambda i: p_values[i])
    m, out, running = len(order), [math.nan] * len(p_values), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        out[i] = running
    return out


def paired_diffs(a: Mapping[int, Mapping[str, Any]], b: Mapping[int, Mapping[str, Any]], key: str) -> list[float]:
    return [a[s][key] - b[s][key] for s in sorted(set(a) & set(b)) if key in a[s] and key in b[s]]
