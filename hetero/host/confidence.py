"""Measured figures with a confidence: the median of repeated samples and a 95% interval around it that holds
whatever the noise looks like.

On a shared machine a timing is disturbed now and then by other processes: a burst slows one sample by 2x while the
next is clean. Such noise is neither normal nor symmetric, so a mean and its t-interval follow the outliers. The
median does not, and its interval needs no model of the noise: with n independent samples, the k-th smallest and the
k-th largest bound the true median with probability 1 - 2 P(Binomial(n, 1/2) < k) (the sign test's interval). Six
samples are the fewest for 95% (both ends then are the extremes: 1 - 2 / 64 = 96.9%).

`Estimate` is such a median with its interval and sample count, as the settings file saves it; `repeat` samples a
callable until the interval is narrow enough or a time cap is reached.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

LEVEL = 0.95  # the intervals' coverage
MIN_SAMPLES = 6  # the fewest with a 95% interval for the median: the extremes, at 96.9%


def median_rank(n: int, level: float = LEVEL) -> int | None:
    """The largest k (1-based) such that [k-th smallest, k-th largest] of n samples covers the median with
    probability >= level; None when n is too small for any k."""
    best, below = None, 0.0  # below: P(Binomial(n, 1/2) < k)
    for k in range(1, n // 2 + 1):
        below += math.comb(n, k - 1) / 2**n
        if 1 - 2 * below < level:
            break
        best = k
    return best


@dataclass(frozen=True)
class Estimate:
    """The median of `n` samples and its distribution-free interval [low, high] (None: too few samples for one)."""

    median: float
    low: float | None
    high: float | None
    n: int

    @classmethod
    def of(cls, samples: list[float], level: float = LEVEL) -> Estimate:
        if not samples:
            raise ValueError("an estimate needs at least one sample")
        xs = sorted(samples)
        k = median_rank(len(xs), level)
        low, high = (xs[k - 1], xs[-k]) if k is not None else (None, None)
        return cls(statistics.median(xs), low, high, len(xs))

    @property
    def known(self) -> bool:
        """Whether there were samples enough for an interval."""
        return self.low is not None

    def above(self, x: float) -> bool:
        """The whole interval lies above x (a ratio's: faster, beyond the noise)."""
        return self.low is not None and self.low > x

    def below(self, x: float) -> bool:
        return self.high is not None and self.high < x

    def within(self, lo: float, hi: float) -> bool:
        """The whole interval lies inside [lo, hi]."""
        return self.low is not None and lo <= self.low and self.high <= hi

    def spread(self) -> float | None:
        """The interval's half width relative to the median (None: no interval)."""
        if self.low is None or not self.median:
            return None
        return (self.high - self.low) / 2 / abs(self.median)

    def scaled(self, f: Callable[[float], float]) -> Estimate:
        """The same estimate through a monotonic map (seconds to a rate: the ends swap when it falls)."""
        ends = None if self.low is None else sorted((f(self.low), f(self.high)))
        return Estimate(f(self.median), *(ends or (None, None)), self.n)

    def text(self, fmt: str = "{:.2f}") -> str:
        """'1.41 (95% interval 1.30-1.52, 9 samples)'."""
        if self.low is None:
            return f"{fmt.format(self.median)} ({self.n} sample{'s' * (self.n != 1)}, too few for an interval)"
        return (f"{fmt.format(self.median)} ({LEVEL:.0%} interval {fmt.format(self.low)}-{fmt.format(self.high)}, "
                f"{self.n} samples)")

    def to_dict(self) -> dict:
        return {"median": self.median, "low": self.low, "high": self.high, "samples": self.n}


def repeat(sample: Callable[[], float], enough: Callable[[Estimate], bool], least: int = MIN_SAMPLES,
           most: int = 40, cap_s: float = 10.0, clock: Callable[[], float] = time.perf_counter
           ) -> tuple[Estimate, list[float]]:
    """Call `sample` (each call returns one measured value) at least `least` times, then until `enough(estimate)`,
    `most` samples, or `cap_s` seconds since the first call; (the estimate, the samples)."""
    start, values = clock(), []
    while True:
        values.append(sample())
        if len(values) >= most or (len(values) >= least and (enough(Estimate.of(values))
                                                               or clock() - start >= cap_s)):
            return Estimate.of(values), values
