"""Fairness metrics over per-tenant GPU time.

- share: a tenant's GPU ms over the busy time of the replicas (0-1).
- max/min ratio: the largest weighted share over the smallest (1.0 is perfectly fair); the seed
  study's headline figure (``shared/seeds/002_26e0ae7acb221c9a.txt``).
- Jain's index: ``(sum x)^2 / (n * sum x^2)`` over weighted shares (R. Jain, D. Chiu, W. Hawe,
  "A Quantitative Measure of Fairness and Discrimination", DEC-TR-301, 1984); 1.0 is fair, 1/n worst.
- service difference: the VTC paper's figure (Sheng et al., OSDI 2024): how far apart the tenants' service
  rates were over sliding windows, counting a tenant's gap only as far as it had demand (``service_difference``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

VTC_WINDOW_S = 60.0  # the VTC artifact's window (fair_bench/plot/visualize.py: window = 60)
VTC_POINTS = 100  # and its sample points (num_x = 100)
# A wait in the queue this long means the tenant wanted more than it got at that moment: several of an
# emulated replica's iterations (10-100 ms), far above the sub-millisecond pass of a request a free slot takes.
# A tenant none of whose requests waited so long is demand-limited: a work-conserving policy gave it all it
# asked, so its share says how much it asked, not how fairly it was served (the report and the dashboard).
BACKLOG_QUEUE_MS = 100.0


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


@dataclass
class RequestSpans:
    """Per request (parallel columns): tenant index, arrival, first token and finish (s; ``nan``: did not
    happen), prompt and output tokens."""

    tenant: list[int] = field(default_factory=list)
    arrival_s: list[float] = field(default_factory=list)
    first_token_s: list[float] = field(default_factory=list)
    finish_s: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)

    def add(
        self, tenant: int, arrival_s: float, first_token_s: float, finish_s: float, prompt: int, output: int
    ) -> None:
        """Append one request."""
        self.tenant.append(tenant)
        self.arrival_s.append(arrival_s)
        self.first_token_s.append(first_token_s)
        self.finish_s.append(finish_s)
        self.prompt_tokens.append(prompt)
        self.output_tokens.append(output)

    def arrays(self) -> list[npt.NDArray[np.float64]]:
        """The six columns as float arrays. Raises ``ValueError``: columns of different lengths."""
        columns: list[Sequence[float]] = [self.tenant, self.arrival_s, self.first_token_s, self.finish_s]
        columns += [self.prompt_tokens, self.output_tokens]
        if len({len(c) for c in columns}) != 1:
            raise ValueError("RequestSpans columns differ in length")
        return [np.asarray(c, dtype=float) for c in columns]


@dataclass(frozen=True)
class ServiceDifference:
    """The VTC paper's fairness figure over one run (Sheng et al., "Fairness in Serving Large Language Models",
    OSDI 2024, section 6; computed as in its artifact, ``fair_bench/plot/visualize.py``).

    Attributes:
        max_per_s / avg_per_s: the largest and the mean, over the sample points, of the summed service gap
            of the tenants (service units per second; with the default weights, tokens per second).
        points: how many sample points the figures are over (0: no request produced service).
    """

    max_per_s: float
    avg_per_s: float
    points: int


def service_difference(
    requests: RequestSpans,
    tenants: int,
    *,
    window_s: float = VTC_WINDOW_S,
    points: int = VTC_POINTS,
    input_weight: float = 1.0,
    output_weight: float = 2.0,
    tenant_weights: Sequence[float] | None = None,
) -> ServiceDifference:
    """How far the tenants' service rates were apart while they had demand, over sliding windows.

    At each of ``points`` instants ``x`` evenly spread over ``[0, last arrival)``, over the window
    ``[x - window_s/2, x + window_s/2]``, each tenant ``j`` has a *service rate* ``s_j`` (the service
    ``input_weight * prompt + output_weight * output`` of each of its requests spread evenly from its first
    token to its finish, the part inside the window, per second) and a *demand rate* ``r_j`` (the service of
    its requests that arrived in the window, per second). The point's figure is
    ``sum_j min(max_k s_k - s_j, |r_j - s_j|)``: the gap to the best-served tenant, counted only as far as
    the tenant wanted more (a tenant that asked for little is not short-changed). Requests that did not
    finish, or produced their tokens in an instant, give no service (as in the artifact). ``tenant_weights``
    divide a tenant's service and demand (weighted VTC).

    Args:
        requests: per request, tenant index and times in s (see ``RequestSpans``).
        tenants: the number of tenants (indices ``0 .. tenants-1``).

    Raises:
        ValueError: ``window_s`` or ``points`` not positive, a weight not positive, or the columns of
            ``requests`` of different lengths.
    """
    if not window_s > 0 or points < 1:
        raise ValueError(f"window_s and points must be > 0, got {window_s} and {points}")
    weights = _tenant_weights(tenants, tenant_weights)
    columns = _Columns(requests, tenants, input_weight, output_weight, weights)
    if not columns.any_served:
        return ServiceDifference(0.0, 0.0, 0)
    step = float(columns.arrival.max()) / points
    gaps = [columns.gap(x - window_s / 2, x + window_s / 2) for x in np.arange(points) * step]
    return ServiceDifference(max(gaps), sum(gaps) / len(gaps), len(gaps))


def service_gap(
    requests: RequestSpans,
    tenants: int,
    low_s: float,
    high_s: float,
    *,
    input_weight: float = 1.0,
    output_weight: float = 2.0,
    tenant_weights: Sequence[float] | None = None,
) -> float:
    """``service_difference``'s figure for the one window ``[low_s, high_s]`` (service units per second; 0.0
    when no request in ``requests`` gave service). Raises ``ValueError``: ``high_s <= low_s``, or as
    ``service_difference``."""
    if not high_s > low_s:
        raise ValueError(f"the window must be positive, got [{low_s}, {high_s}]")
    weights = _tenant_weights(tenants, tenant_weights)
    columns = _Columns(requests, tenants, input_weight, output_weight, weights)
    return columns.gap(low_s, high_s) if columns.any_served else 0.0


def _tenant_weights(tenants: int, given: Sequence[float] | None) -> npt.NDArray[np.float64]:
    weights = np.ones(tenants) if given is None else np.asarray(given, dtype=float)
    if weights.shape != (tenants,) or not np.all(weights > 0):
        raise ValueError(f"tenant_weights must be {tenants} values > 0")
    return weights


class _Columns:
    """The requests as arrays, with each one's service (weighted) and whether it was served over a span."""

    def __init__(
        self,
        requests: RequestSpans,
        tenants: int,
        input_weight: float,
        output_weight: float,
        weights: npt.NDArray[np.float64],
    ) -> None:
        tenant, arrival, start, end, prompt, output = requests.arrays()
        self.tenants = tenants
        self.tenant = tenant.astype(int)
        self.arrival, self.start, self.end = arrival, start, end
        self.service = (input_weight * prompt + output_weight * output) / weights[self.tenant]
        self.served = np.isfinite(start) & np.isfinite(end) & (end - start > 1e-9)
        self.span = np.where(self.served, end - start, 1.0)
        self.any_served = bool(len(arrival)) and bool(self.served.any())

    def gap(self, low: float, high: float) -> float:
        """``sum_j min(max_k s_k - s_j, |r_j - s_j|)`` over the window ``[low, high]``."""
        window = high - low
        overlap = np.clip(np.minimum(high, self.end) - np.maximum(low, self.start), 0.0, None)
        rate = np.where(self.served, self.service * overlap / self.span, 0.0)
        s = np.bincount(self.tenant, weights=rate, minlength=self.tenants) / window
        arrived = (self.arrival >= low) & (self.arrival <= high)
        r = np.bincount(self.tenant, weights=np.where(arrived, self.service, 0.0), minlength=self.tenants) / window
        return float(np.minimum(s.max() - s, np.abs(r - s)).sum())
