"""Least-squares fits of the cost model's parameters from timed probes (``fairgate calibrate``).

The cost model (README, "The charge rule"; seed 002) says an iteration of ``B`` running sequences takes
``iter_base_ms + iter_slope_ms * B`` and a prompt of ``L`` tokens adds ``prefill_ms_per_token * L`` to the
iteration that prefills it. A decode probe measures the step time at several ``B``; a prefill probe measures
the time to first token at several ``L`` (the step that prefills it, plus a constant: the first decode step,
network and scheduling). Each is one ordinary least-squares line; the parameter's standard error is the
textbook one (residual variance over the spread of ``x``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Line:
    """``y = intercept + slope * x`` fitted to ``points`` (x, y); standard errors of both, and the largest
    residual relative to its measured ``y`` (0.1 = 10 %)."""

    intercept: float
    slope: float
    intercept_se: float
    slope_se: float
    max_rel_residual: float
    points: tuple[tuple[float, float], ...]

    def at(self, x: float) -> float:
        return self.intercept + self.slope * x


def fit_line(points: Sequence[tuple[float, float]]) -> Line:
    """The least-squares line through ``points``. Raises ``ValueError`` with fewer than two distinct ``x``."""
    n = len(points)
    xs = [float(x) for x, _ in points]
    ys = [float(y) for _, y in points]
    if n < 2 or len(set(xs)) < 2:
        raise ValueError("a line needs points at two different x at least")
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sxx
    intercept = mean_y - slope * mean_x
    residuals = [y - (intercept + slope * x) for x, y in zip(xs, ys, strict=True)]
    variance = sum(r * r for r in residuals) / (n - 2) if n > 2 else 0.0
    slope_se = math.sqrt(variance / sxx)
    intercept_se = math.sqrt(variance * (1.0 / n + mean_x**2 / sxx))
    worst = max((abs(r) / abs(y) for r, y in zip(residuals, ys, strict=True) if y), default=0.0)
    return Line(intercept, slope, intercept_se, slope_se, worst, tuple(zip(xs, ys, strict=True)))


def median(values: Sequence[float]) -> float:
    """The median of ``values``. Raises ``ValueError`` when empty."""
    if not values:
        raise ValueError("the median of nothing")
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0


def steady_step_ms(arrivals_s: Sequence[Sequence[float]]) -> float | None:
    """The decode step time (ms) of ``B`` streams that ran together: the median gap between consecutive
    tokens of each stream, counted only while every stream was decoding (after the last first token and
    before the first last token), so the batch was ``B`` throughout. None if that window holds no gap."""
    if not arrivals_s or any(len(a) < 2 for a in arrivals_s):
        return None
    start = max(a[0] for a in arrivals_s)
    end = min(a[-1] for a in arrivals_s)
    gaps = [(b - a) * 1000.0 for stream in arrivals_s for a, b in itertools.pairwise(stream) if start <= a and b <= end]
    return median(gaps) if gaps else None
