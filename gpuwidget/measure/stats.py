"""The statistics of an A/B measurement: a distribution-free interval for the median speed-up, and the verdict.

Each ABBA block (unchanged, changed, changed, unchanged) gives one paired ratio: the changed step's
throughput over the unchanged one's within the block, so a machine that slows down or speeds up over
the measurement (other processes, clocks, a warming cache) moves both sides of a block alike and a
linear drift cancels inside it. The blocks' ratios are then treated as independent draws.

The interval is the sign-test (binomial order-statistic) confidence interval for their median: the
k-th smallest and k-th largest ratio, k the largest for which ``2 * P(Binomial(n, 1/2) < k) <= 0.05``.
It assumes nothing about the ratios' distribution, and one block disturbed by a neighbour's burst
moves it by one rank at most, where a mean and a t interval would be dragged by it; a bootstrap of
the median would need many resamples and be too narrow at small n. It needs six blocks for 95%
(fewer give the range of what there is, with its lower coverage stated).

The verdict reads the interval only (and only a 95% one: fewer blocks decide nothing): ``"faster"``
when all of it is above 1 and it reaches past a
negligible gain (:data:`NEGLIGIBLE`), ``"slower"`` likewise below, else ``"no difference"``: an
interval that straddles 1 (not decided) or lies within ±2% (decided as too small to matter).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

CONFIDENCE = 0.95
# Speed-ups within this share of 1 are "no difference" even when the interval excludes 1: a 1% change
# is within what a copy's memory layout or a neighbour's load moves a measurement by.
NEGLIGIBLE = 0.02


@dataclass(frozen=True)
class Interval:
    """The median ratio, its interval and the interval's actual coverage (at least CONFIDENCE from 6 blocks)."""

    median: float
    low: float
    high: float
    coverage: float
    blocks: int

    @property
    def half_width(self) -> float:
        """Half the interval's width, relative to the median (0.05: ±5%)."""
        return (self.high - self.low) / 2 / self.median if self.median > 0 else math.inf


def _binomial_cdf(k: int, n: int) -> float:
    """P(Binomial(n, 1/2) <= k)."""
    return sum(math.comb(n, i) for i in range(0, k + 1)) / 2 ** n


def median_interval(ratios: Sequence[float], confidence: float = CONFIDENCE) -> Interval | None:
    """The sign-test interval for the median of ``ratios``; None without any."""
    values = sorted(r for r in ratios if math.isfinite(r) and r > 0)
    n = len(values)
    if not n:
        return None
    middle = n // 2
    median = values[middle] if n % 2 else math.sqrt(values[middle - 1] * values[middle])
    alpha = 1 - confidence
    # The largest k (1-based rank) with 2 * P(B <= k - 1) <= alpha; k = 1 is the full range.
    k = 1
    while k < middle + 1 and 2 * _binomial_cdf(k, n) <= alpha:
        k += 1
    coverage = 1 - 2 * _binomial_cdf(k - 1, n)
    return Interval(median, values[k - 1], values[n - k], coverage, n)


def verdict(interval: Interval | None) -> str:
    """``faster``, ``slower`` or ``no difference``, from the interval alone (the module docstring)."""
    if interval is None or interval.coverage < CONFIDENCE:
        return "no difference"  # fewer than six blocks: no 95% interval, nothing decided
    if interval.low > 1.0 and interval.high > 1.0 + NEGLIGIBLE:
        return "faster"
    if interval.high < 1.0 and interval.low < 1.0 - NEGLIGIBLE:
        return "slower"
    return "no difference"


def block_ratio(unchanged: Sequence[tuple[float, float]], changed: Sequence[tuple[float, float]]) -> float:
    """One block's throughput ratio from its runs' (samples, seconds): the changed side's samples per
    second over the unchanged side's, each pooled over its runs in the block."""
    rate_unchanged = sum(s for s, _ in unchanged) / sum(t for _, t in unchanged)
    rate_changed = sum(s for s, _ in changed) / sum(t for _, t in changed)
    return rate_changed / rate_unchanged
