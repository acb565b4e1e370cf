"""The benchmarks' statistics over rounds: a median with a distribution-free confidence interval
(`median_ci`), the coverage that interval really has with few rounds, and the same for the
per-round ratios of two configurations timed in the same rounds (`ratio_ci`: load common to a
round cancels). They assume only that the rounds are independent draws, not the times' shape.
"""

from __future__ import annotations

import math
import statistics


def median_ci(values: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """The median of `values` and a distribution-free confidence interval for it.

    Order-statistic (binomial) interval: sorted x(1) ≤ … ≤ x(n), the interval is
    [x(k), x(n+1-k)] for the largest k with 2·P(Binomial(n, ½) < k) ≤ 1 − confidence; it
    assumes only that the values are independent draws (one per round), not their shape.
    Below 6 values no k reaches 95 %: the interval is then [min, max] (coverage 1 − 2^(1−n)).

    Returns:
        (median, low, high).

    Raises:
        ValueError: no values.
    """
    if not values:
        raise ValueError("median_ci of no values: time at least one round")
    xs, n = sorted(values), len(values)
    k = _order(n, confidence)
    return statistics.median(xs), xs[k - 1], xs[n - k]


def _tail(n: int, j: int) -> float:
    """P(Binomial(n, 1/2) <= j)."""
    return sum(math.comb(n, i) for i in range(j + 1)) / 2**n


def _order(n: int, confidence: float) -> int:
    """The k of `median_ci`'s interval [x(k), x(n+1-k)]."""
    k = 1
    while k + 1 <= (n + 1) // 2 and 2 * _tail(n, k) <= 1 - confidence:
        k += 1
    return k


def median_ci_coverage(n: int, confidence: float = 0.95) -> float:
    """The coverage `median_ci` really has with n values: at least `confidence` from 6 values on."""
    return 1 - 2 * _tail(n, _order(n, confidence) - 1)


def ratio_ci(numerators: list[float], denominators: list[float],
             confidence: float = 0.95) -> tuple[float, float, float]:
    """`median_ci` of the per-round ratios numerator / denominator (the lists pair by round)."""
    return median_ci([a / b for a, b in zip(numerators, denominators, strict=True)], confidence)
