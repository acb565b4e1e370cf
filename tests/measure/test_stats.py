"""The benchmarks' statistics over rounds (`measure.stats`)."""

import pytest

from brigade.measure.stats import median_ci, median_ci_coverage


def test_median_ci_is_the_order_statistic_interval():
    assert median_ci([float(v) for v in range(10, 0, -1)]) == (5.5, 2.0, 9.0)  # x(2)..x(9) of 10
    assert median_ci([1.0, 5.0, 2.0, 4.0, 3.0, 9.0, 7.0, 8.0]) == (4.5, 1.0, 9.0)  # 8: min..max
    assert median_ci_coverage(10) >= 0.95 and median_ci_coverage(5) == pytest.approx(0.9375)
    with pytest.raises(ValueError, match="no values"):
        median_ci([])
