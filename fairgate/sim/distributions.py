"""Length distributions for prompts and outputs: fixed, lognormal (mean, cv), empirical (from a trace).

Lognormal by mean and coefficient of variation: ``sigma^2 = ln(1 + cv^2)``, ``mu = ln(mean) - sigma^2/2``
(the standard moment parametrisation). Samples are rounded to whole tokens and floored at ``minimum``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Fixed:
    """Always ``value`` tokens."""

    value: int

    @property
    def mean(self) -> float:
        return float(self.value)

    def sample(self, rng: np.random.Generator, size: int, minimum: int) -> list[int]:
        return [max(self.value, minimum)] * size


@dataclass(frozen=True)
class LogNormal:
    """Lognormal tokens with the given ``mean`` (> 0) and coefficient of variation ``cv`` (>= 0)."""

    mean: float
    cv: float

    def sample(self, rng: np.random.Generator, size: int, minimum: int) -> list[int]:
        sigma2 = math.log1p(self.cv * self.cv)
        mu = math.log(self.mean) - sigma2 / 2
        values = rng.lognormal(mu, math.sqrt(sigma2), size) if sigma2 > 0 else np.full(size, self.mean)
        counts: list[int] = np.maximum(np.rint(values), minimum).astype(np.int64).tolist()
        return counts


@dataclass(frozen=True)
class Empirical:
    """Tokens drawn uniformly, with replacement, from ``values`` (e.g. a trace column)."""

    values: tuple[int, ...]
    source: str = ""

    @property
    def mean(self) -> float:
        return float(sum(self.values)) / len(self.values)

    @classmethod
    def of(cls, values: Sequence[int], source: str = "") -> Empirical:
        if not values:
            raise ValueError(f"empirical distribution from {source or 'data'} has no values")
        return cls(tuple(int(v) for v in values), source)

    def sample(self, rng: np.random.Generator, size: int, minimum: int) -> list[int]:
        picks = rng.integers(0, len(self.values), size)
        values = np.asarray(self.values, dtype=np.int64)[picks]
        counts: list[int] = np.maximum(values, minimum).tolist()
        return counts


Distribution = Fixed | LogNormal | Empirical
