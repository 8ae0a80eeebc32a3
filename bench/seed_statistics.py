"""The statistics of bench/shapebench_compare.py: an interval over training seeds and a curve read
at a point between its measurements. Pure functions, tested on inputs with known answers
(tests/test_bench_shapebench_compare.py)."""

from __future__ import annotations

import math
from bisect import bisect_left
from typing import NamedTuple

from scipy.stats import t as student_t


class Interval(NamedTuple):
    mean: float
    low: float  # nan with fewer than 2 values
    high: float
    n: int

    def __str__(self) -> str:
        if self.n < 2:
            return f"{self.mean:.3f} (1 seed)"
        return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}]"


def t_interval(values: list[float], confidence: float = 0.95) -> Interval:
    """The t-interval for the mean of ``values``, one per training seed: ``mean +- t s / sqrt(n)``,
    ``s`` the sample standard deviation (n - 1 in the denominator) and ``t`` Student's t quantile
    at ``(1 + confidence) / 2`` with n - 1 degrees of freedom. It treats the seeds' results as
    independent draws from the run-to-run distribution (training draws and held-out noise both vary
    with the seed), so it says where the mean over all seeds lies, not where one run lands."""
    n = len(values)
    if n == 0:
        raise ValueError("t_interval needs at least one value")
    mean = sum(values) / n
    if n == 1:
        return Interval(mean, math.nan, math.nan, 1)
    s = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = student_t.ppf((1 + confidence) / 2, n - 1) * s / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def value_at(xs: list[float], ys: list[float], x: float) -> float:
    """The curve through the points ``(xs[i], ys[i])`` (``xs`` increasing) read at ``x``, linear
    between the two measurements around it; ``x`` outside ``[xs[0], xs[-1]]`` is an error (a curve
    is not extrapolated)."""
    if len(xs) != len(ys) or not xs:
        raise ValueError(f"value_at: {len(xs)} x values and {len(ys)} y values")
    if any(b <= a for a, b in zip(xs, xs[1:])):
        raise ValueError(f"value_at: x values must increase, got {xs}")
    if not xs[0] <= x <= xs[-1]:
        raise ValueError(f"value_at: {x} is outside the measured range [{xs[0]}, {xs[-1]}]")
    i = bisect_left(xs, x)
    if xs[i] == x:
        return ys[i]
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
