"""Fairness metrics over per-tenant GPU time.

- share: a tenant's GPU ms over the busy time of the replicas (0-1).
- max/min ratio: the largest weighted share over the smallest (1.0 is perfectly fair); the seed
  study's headline figure (``shared/seeds/002_26e0ae7acb221c9a.txt``).
- Jain's index: ``(sum x)^2 / (n * sum x^2)`` over weighted shares (R. Jain, D. Chiu, W. Hawe,
  "A Quantitative Measure of Fairness and Discrimination", DEC-TR-301, 1984); 1.0 is fair, 1/n worst.
"""

from __future__ import annotations

from collections.abc import Mapping


def gpu_shares(gpu_ms: Mapping[str, float], busy_ms: float) -> dict[str, float]:
    """Each tenant's GPU ms as a fraction of ``busy_ms``.

    Raises:
        ValueError: ``busy_ms`` is not positive.
    """
    if not busy_ms > 0:
        raise ValueError(f"busy_ms must be > 0, got {busy_ms}")
    return {tenant: ms / busy_ms for tenant, ms in gpu_ms.items()}


def weighted(shares: Mapping[str, float], weights: Mapping[str, float]) -> dict[str, float]:
    """Shares divided by each tenant's weight (absent weight: 1)."""
    return {tenant: share / weights.get(tenant, 1.0) for tenant, share in shares.items()}


def _some(values: Mapping[str, float], figure: str) -> list[float]:
    if not values:
        raise ValueError(f"{figure} needs at least one value")
    return list(values.values())


def max_min_ratio(values: Mapping[str, float]) -> float:
    """Largest value over smallest; ``inf`` if the smallest is 0. Raises ``ValueError``: no values."""
    xs = _some(values, "max_min_ratio")
    low, high = min(xs), max(xs)
    return float("inf") if low <= 0 else high / low


def jain_index(values: Mapping[str, float]) -> float:
    """Jain's fairness index of ``values`` (1.0 when all equal; Jain, Chiu, Hawe, DEC-TR-301, 1984). Raises
    ``ValueError``: no values."""
    xs = _some(values, "jain_index")
    square_sum = sum(x * x for x in xs)
    if square_sum == 0:
        return 1.0
    return sum(xs) ** 2 / (len(xs) * square_sum)
