import math

import pytest

from sage_jax.experiments import stats


def test_mean_ci_against_hand_computed_values():
    mean, half = stats.mean_ci([1.0, 2.0, 3.0])  # sd 1, t_{0.975,2} = 4.303
    assert mean == pytest.approx(2.0)
    assert half == pytest.approx(4.303 / math.sqrt(3), rel=1e-6)
    mean, half = stats.mean_ci([2, 4, 4, 4, 5, 5, 7, 9])  # sd = sqrt(32/7), t_{0.975,7} = 2.365
    assert mean == pytest.approx(5.0)
    assert half == pytest.approx(2.365 * math.sqrt(32 / 7) / math.sqrt(8), rel=1e-6)
    assert stats.mean_ci([0.25, 0.25]) == (0.25, 0.0)
    mean, half = stats.mean_ci([0.5])
    assert mean == 0.5 and math.isnan(half)
    assert math.isnan(stats.mean_ci([])[0])
    assert stats.t_quantile_975(11) == 2.228  # between table rows: the wider interval
    assert stats.fmt(0.12345, 0.01) == "0.123 ± 0.010" and stats.fmt(0.5) == "0.500"


def test_paired_difference_uses_common_seeds():
    a = {0: {"x": 1.0}, 1: {"x": 2.0}, 2: {"x": 4.0}, 3: {"x": 9.0}}
    b = {0: {"x": 0.0}, 1: {"x": 1.0}, 2: {"x": 1.0}}
    mean, half, count = stats.paired_difference(a, b, "x")  # diffs 1, 1, 3: sd sqrt(4/3)
    assert count == 3
    assert mean == pytest.approx(5 / 3)
    assert half == pytest.approx(4.303 * math.sqrt(4 / 3) / math.sqrt(3), rel=1e-6)


def test_t_distribution_holm_and_minimum_detectable_effect():
    assert stats.t_cdf(4.303, 2) == pytest.approx(0.975, abs=1e-4)  # the table's t_{0.975, 2}
    assert stats.t_cdf(0.0, 7) == pytest.approx(0.5) and stats.t_cdf(-2.262, 9) == pytest.approx(0.025, abs=1e-4)
    assert stats.t_ppf(0.975, 9) == pytest.approx(2.262, abs=1e-3) and stats.t_ppf(0.8, 9) == pytest.approx(0.883,
                                                                                                      abs=1e-3)
    r = stats.paired_test([0.1, 0.2, -0.05, 0.15])  # mean 0.1, sd 0.108: t = 1.852 on 3 df
    assert r["p"] == pytest.approx(0.1612, abs=1e-4) and r["n"] == 4
    assert r["mde"] == pytest.approx((3.182 + 0.978) * r["sd"] / 2, rel=1e-3)
    assert math.isnan(stats.paired_test([0.3])["p"])
    # Holm: sorted p 0.01, 0.03, 0.04, 0.2 times 4, 3, 2, 1, kept monotone; NaN is not a comparison
    assert stats.holm([0.01, 0.04, 0.03, math.nan, 0.2])[:3] == pytest.approx([0.04, 0.09, 0.09])
    assert math.isnan(stats.holm([math.nan])[0])


def test_pass_curve_is_the_unbiased_estimator():
    problems = [{"n": 4, "correct": c} for c in (0, 2, 4)]
    curve = stats.pass_curve(problems)
    assert len(curve) == 4
    assert curve[0] == pytest.approx((0 + 0.5 + 1) / 3)
    assert curve[1] == pytest.approx((0 + (1 - 1 / 6) + 1) / 3)  # c=2 of 4: 1 - C(2,2)/C(4,2)
    assert curve[3] == pytest.approx(2 / 3)
