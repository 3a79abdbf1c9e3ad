import numpy as np
import pytest

from sage_jax.bench import workloads


@pytest.mark.parametrize("rows, max_new", [(64, 512), (64, 3072), (10, 100), (512, 512)])
def test_longtail_median_a_fifth_and_some_rows_at_the_max(rows, max_new):
    lengths = workloads.longtail_lengths(rows, max_new, seed=1)
    assert lengths.dtype == np.int32 and lengths.shape == (rows,)
    assert lengths.min() >= 1 and lengths.max() == max_new
    assert abs(np.median(lengths) / max_new - 0.2) < 0.03
    assert np.mean(lengths == max_new) >= 0.02


def test_longtail_same_lengths_for_every_seed_in_another_order():
    a, b = workloads.longtail_lengths(64, 512, seed=0), workloads.longtail_lengths(64, 512, seed=1)
    np.testing.assert_array_equal(np.sort(a), np.sort(b))
    assert (a != b).any()
    np.testing.assert_array_equal(a, workloads.longtail_lengths(64, 512, seed=0))


def test_workload_lengths_and_quantiles():
    np.testing.assert_array_equal(workloads.workload_lengths("fixed", 3, 7), [7, 7, 7])
    q = workloads.length_quantiles([1, 2, 3, 10], 10)
    assert q["len_p50"] == 2.5 and q["len_max"] == 10 and q["frac_at_max"] == 0.25 and q["tokens"] == 16
    with pytest.raises(ValueError, match="unknown workload"):
        workloads.workload_lengths("heavy", 3, 7)


def test_tokens_before_eos():
    rows = np.array([[5, 1, 7, 1], [5, 6, 7, 8], [1, 0, 0, 0]])
    np.testing.assert_array_equal(workloads.tokens_before_eos(rows, [1]), [1, 4, 0])
    np.testing.assert_array_equal(workloads.tokens_before_eos(rows, []), [4, 4, 4])
