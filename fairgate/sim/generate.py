"""Synthetic workloads: per-tenant Poisson arrivals at an offered load given in machine time.

``offered_ms_per_s`` is the GPU time a tenant offers per second of wall time; its arrival rate is
``offered_ms_per_s / (mean_prompt * prefill_ms_per_token + mean_output * dt(max_batch)/max_batch)``
per second (seed 002: "750.0 ms of machine per second each"). Each tenant's first request
arrives at t = 0, the rest after exponential gaps, so every tenant is present from the start.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fairgate.core.cost import NS_PER_MS, CostModel
from fairgate.sim.distributions import Distribution
from fairgate.sim.workload import Workload

MAX_REQUESTS = 5_000_000  # per workload: beyond this a run would take hours and gigabytes
MAX_FLOOD = 1000.0


class WorkloadError(ValueError):
    """The workload cannot be built as asked (no load at all, or too large to simulate)."""


@dataclass(frozen=True)
class TenantLoad:
    """One synthetic tenant.

    Attributes:
        name: tenant name.
        prompt_tokens: prompt length distribution.
        output_tokens: output length distribution.
        offered_ms_per_s: offered load in machine ms per second (>= 0).
    """

    name: str
    prompt_tokens: Distribution
    output_tokens: Distribution
    offered_ms_per_s: float


def request_cost_ms(cost: CostModel, tenant: TenantLoad) -> float:
    """Machine time of one mean request of ``tenant`` at a full batch, ms."""
    return tenant.prompt_tokens.mean * cost.prefill_ms_per_token + tenant.output_tokens.mean * cost.decode_charge_ms(
        cost.max_batch
    )


def arrival_rate_per_s(cost: CostModel, tenant: TenantLoad) -> float:
    """Poisson arrival rate of ``tenant``, requests per second."""
    return tenant.offered_ms_per_s / request_cost_ms(cost, tenant)


def check_workload_size(
    cost: CostModel, tenants: list[TenantLoad], duration_s: float, flood: dict[str, float] | None = None
) -> None:
    """Refuse a workload that is empty or too large to simulate, before building it.

    Raises:
        WorkloadError: ``flood`` names an unknown tenant or a multiplier outside (0, MAX_FLOOD]; no tenant
            offers load; or more than ``MAX_REQUESTS`` requests would be generated.
    """
    flood = flood or {}
    names = [t.name for t in tenants]
    for name, factor in flood.items():
        if name not in names:
            raise WorkloadError(f"flood names unknown tenant {name!r}; tenants are {', '.join(names)}")
        if not 0 < factor <= MAX_FLOOD:
            raise WorkloadError(f"flood multiplier for {name!r} must be in (0, {MAX_FLOOD:g}], got {factor}")
    expected = sum(arrival_rate_per_s(cost, t) * flood.get(t.name, 1.0) for t in tenants) * duration_s
    if expected <= 0:
        raise WorkloadError("no tenant offers any load (offered_ms_per_s is 0 for every tenant)")
    if expected > MAX_REQUESTS:
        raise WorkloadError(
            f"the workload would have about {expected:,.0f} requests (at most {MAX_REQUESTS:,}): "
            "shorten run.duration_s or lower offered_ms_per_s / --flood"
        )


def poisson_workload(
    cost: CostModel, tenants: list[TenantLoad], duration_s: float, seed: int, flood: dict[str, float] | None = None
) -> Workload:
    """Poisson arrivals for every tenant over ``[0, duration_s)``, merged in time order.

    Args:
        flood: tenant -> multiplier of its offered load (seed 002's floods).

    Raises:
        WorkloadError: see ``check_workload_size``.
    """
    check_workload_size(cost, tenants, duration_s, flood)
    flood = flood or {}
    names = [t.name for t in tenants]
    duration_ns = round(duration_s * 1e9)
    columns: list[tuple[np.ndarray, int, list[int], list[int]]] = []
    for k, tenant in enumerate(tenants):
        rng = np.random.default_rng([seed, k])
        rate = arrival_rate_per_s(cost, tenant) * flood.get(tenant.name, 1.0)
        if rate <= 0:
            continue
        expected = rate * duration_s
        gaps = rng.exponential(1.0 / rate, int(expected + 10 * np.sqrt(expected) + 20))
        # Every tenant comes online at t = 0 with a request: the first arrival is at 0 and the gaps
        # after it are exponential (seed 002: all tenants backlogged over the whole run).
        times = np.concatenate([[0.0], np.cumsum(gaps)])
        while times[-1] < duration_s:  # rare: draw more
            more = np.cumsum(rng.exponential(1.0 / rate, len(gaps))) + times[-1]
            times = np.concatenate([times, more])
        times = times[times < duration_s]
        arrivals = np.rint(times * 1e9).astype(np.int64)
        size = len(arrivals)
        columns.append(
            (arrivals, k, tenant.prompt_tokens.sample(rng, size, 0), tenant.output_tokens.sample(rng, size, 1))
        )
    return merge(names, columns, duration_ns)


def merge(names: list[str], columns: list[tuple[np.ndarray, int, list[int], list[int]]], duration_ns: int) -> Workload:
    """Merge per-tenant columns ``(arrival_ns, tenant index, prompts, outputs)`` into one workload."""
    if not columns:
        return Workload(tenants=names, duration_ns=duration_ns)
    arrival = np.concatenate([c[0] for c in columns])
    tenant = np.concatenate([np.full(len(c[0]), c[1], dtype=np.int64) for c in columns])
    prompt = np.concatenate([np.asarray(c[2], dtype=np.int64) for c in columns])
    output = np.concatenate([np.asarray(c[3], dtype=np.int64) for c in columns])
    order = np.lexsort((tenant, arrival))
    return Workload(
        tenants=names,
        arrival_ns=arrival[order].tolist(),
        tenant_index=tenant[order].tolist(),
        prompt_tokens=prompt[order].tolist(),
        output_tokens=output[order].tolist(),
        duration_ns=duration_ns,
    )


__all__ = [
    "MAX_FLOOD",
    "MAX_REQUESTS",
    "NS_PER_MS",
    "TenantLoad",
    "WorkloadError",
    "arrival_rate_per_s",
    "check_workload_size",
    "merge",
    "poisson_workload",
    "request_cost_ms",
]
