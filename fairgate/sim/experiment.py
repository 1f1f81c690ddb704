"""Run policies over seeds and summarise each run the way the seed study reports it.

Per tenant: GPU ms and share of busy time, prefill ms, decode tokens, finished requests, mean output
tokens of finished requests, TTFT p50/p99 (ms, over requests that produced a first token). Per run:
busy and charged ms, max/min of weighted shares, Jain's index, the VTC paper's service difference (max and
mean over 60-s windows, tokens/s; ``core.fairness.service_difference``), decode tokens, prefill fraction,
requests that did not finish.
Averages over seeds are plain means of the per-seed figures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from statistics import fmean
from typing import Any

import numpy as np

from fairgate.core.cost import NS_PER_MS
from fairgate.core.fairness import RequestSpans, gpu_shares, jain_index, max_min_ratio, service_difference, weighted
from fairgate.core.policies.factory import make_policy
from fairgate.sim.engine_compressed import run_compressed
from fairgate.sim.engine_reference import run_reference
from fairgate.sim.generate import poisson_workload
from fairgate.sim.result import NOT_YET, SimResult
from fairgate.sim.scenario import Scenario, ScenarioError
from fairgate.sim.workload import Workload

ENGINES: dict[str, Callable[..., SimResult]] = {"compressed": run_compressed, "reference": run_reference}


@dataclass
class TenantStats:
    """One tenant's figures in one run (or their mean over seeds)."""

    name: str
    gpu_ms: float
    gpu_share: float  # fraction of busy time, 0-1
    prefill_ms: float
    decode_tokens: float
    requests_finished: float
    mean_output_tokens: float
    ttft_ms: dict[str, float]  # {"p50": ms, "p99": ms}


@dataclass
class RunStats:
    """One policy on one workload."""

    policy: str
    seed: int
    busy_ms: float
    charged_ms: float
    max_min_ratio: float
    jain_index: float
    decode_tokens: float
    prefill_fraction: float
    tenants: list[TenantStats]
    service_diff_max: float = float("nan")  # VTC paper's figure, tokens/s (weighted: / weight)
    service_diff_avg: float = float("nan")
    unfinished: float = 0.0  # requests not finished when the run ended (cut at the window, or held)
    timeline_s: list[float] = field(default_factory=list, repr=False)  # sample times, s
    timeline_share: list[list[float]] = field(default_factory=list, repr=False)  # cumulative share per tenant


@dataclass
class PolicyStats:
    """A policy's figures averaged over seeds, with each seed's beside them."""

    mean: RunStats
    per_seed: list[RunStats]

    def to_json(self) -> dict[str, Any]:
        """The JSON object of one policy's run: policy, busy_ms, ..., tenants, and ``per_seed``."""
        out = _run_json(self.mean)
        out["seeds"] = [r.seed for r in self.per_seed]
        out["per_seed"] = [_run_json(r) for r in self.per_seed]
        return out


def _run_json(run: RunStats) -> dict[str, Any]:
    data = asdict(run)
    data.pop("timeline_s")
    data.pop("timeline_share")
    data.pop("seed")
    return data


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def _weighted_shares(result: SimResult, weights: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """Each tenant's GPU share of the busy time, and that share over its weight."""
    names, busy_ms = result.workload.tenants, result.busy_ms
    gpu = dict(zip(names, result.tenant_gpu_ms, strict=True))
    shares = gpu_shares(gpu, busy_ms) if busy_ms > 0 else dict.fromkeys(names, 0.0)
    return shares, weighted(shares, weights)


def fair_ratio(result: SimResult, weights: dict[str, float]) -> float:
    """One run's max/min of the weighted GPU shares (``RunStats.max_min_ratio``) alone: what a sweep keeps of
    a run, without the rest of ``summarise`` (a quarter of a grid run's time: percentiles, timelines, the
    service difference)."""
    return max_min_ratio(_weighted_shares(result, weights)[1]) if result.busy_ms > 0 else float("nan")


def summarise(result: SimResult, policy: str, seed: int, weights: dict[str, float]) -> RunStats:
    """Figures of one run (see module docstring)."""
    workload = result.workload
    busy_ms = result.busy_ms
    names = workload.tenants
    shares, fair = _weighted_shares(result, weights)
    ttft: list[list[float]] = [[] for _ in names]
    outputs: list[list[int]] = [[] for _ in names]
    for i, first in enumerate(result.first_token_ns):
        k = workload.tenant_index[i]
        if first != NOT_YET:
            ttft[k].append((first - workload.arrival_ns[i]) / NS_PER_MS)
        if result.finish_ns[i] != NOT_YET:
            outputs[k].append(result.generated_tokens[i])
    tenants = [
        TenantStats(
            name=name,
            gpu_ms=result.tenant_gpu_ms[k],
            gpu_share=shares[name],
            prefill_ms=result.tenant_prefill_ms[k],
            decode_tokens=result.tenant_decode_tokens[k],
            requests_finished=len(outputs[k]),
            mean_output_tokens=fmean(outputs[k]) if outputs[k] else 0.0,
            ttft_ms={"p50": _percentile(ttft[k], 50), "p99": _percentile(ttft[k], 99)},
        )
        for k, name in enumerate(names)
    ]
    difference = service_difference(_spans(result), len(names), tenant_weights=[weights.get(n, 1.0) for n in names])
    timeline_s: list[float] = []
    timeline_share: list[list[float]] = []
    for t_ns, cumulative in result.timeline:
        total = sum(cumulative)
        if total > 0:
            timeline_s.append(t_ns / 1e9)
            timeline_share.append([c / total for c in cumulative])
    return RunStats(
        policy=policy,
        seed=seed,
        busy_ms=busy_ms,
        charged_ms=result.charged_ms,
        max_min_ratio=max_min_ratio(fair) if busy_ms > 0 else float("nan"),
        jain_index=jain_index(fair) if busy_ms > 0 else float("nan"),
        decode_tokens=sum(result.tenant_decode_tokens),
        prefill_fraction=sum(result.tenant_prefill_ms) / busy_ms if busy_ms > 0 else 0.0,
        tenants=tenants,
        service_diff_max=difference.max_per_s,
        service_diff_avg=difference.avg_per_s,
        unfinished=sum(1 for f in result.finish_ns if f == NOT_YET),
        timeline_s=timeline_s,
        timeline_share=timeline_share,
    )


def _spans(result: SimResult) -> RequestSpans:
    """Each request's tenant, times (s) and tokens, for ``service_difference``."""
    workload, spans, nan = result.workload, RequestSpans(), float("nan")
    for i, arrival in enumerate(workload.arrival_ns):
        first, finish = result.first_token_ns[i], result.finish_ns[i]
        spans.add(
            workload.tenant_index[i],
            arrival / 1e9,
            nan if first == NOT_YET else first / 1e9,
            nan if finish == NOT_YET else finish / 1e9,
            workload.prompt_tokens[i],
            result.generated_tokens[i],
        )
    return spans


def simulate(
    scenario: Scenario, workload: Workload, policy: str, engine: str = "compressed", *, drain: bool = False
) -> SimResult:
    """Run ``workload`` through a fresh ``policy`` on the scenario's replicas; ``drain``: until the last request
    finished, not only to the workload's window."""
    names = workload.tenants
    shares = {name: scenario.shares[name] for name in names if name in scenario.shares}
    try:
        built = make_policy(scenario.policy_spec(policy), scenario.cost, shares)
    except ValueError as exc:
        raise ScenarioError(f"{scenario.path}: policy {policy}: {exc}") from None
    return ENGINES[engine](workload, scenario.cost, built, scenario.replicas, drain=drain)


def run_policy(
    scenario: Scenario,
    policy: str,
    seeds: Sequence[int],
    flood: dict[str, float] | None = None,
    engine: str = "compressed",
    workloads: dict[int, Workload] | None = None,
    *,
    drain: bool = False,
) -> PolicyStats:
    """``policy`` on the scenario's synthetic workload for each seed, summarised and averaged.

    Args:
        workloads: seed -> workload to reuse (e.g. across policies); built when absent.
        drain: run each until its last request finished (default: stop at ``run.duration_s``, the seed
            study's convention).
    """
    runs = []
    for seed in seeds:
        workload = (workloads or {}).get(seed)
        if workload is None:
            workload = poisson_workload(scenario.cost, scenario.tenants, scenario.config.run.duration_s, seed, flood)
        result = simulate(scenario, workload, policy, engine, drain=drain)
        runs.append(summarise(result, policy, seed, _weights(scenario, workload)))
    return PolicyStats(mean=average(runs), per_seed=runs)


def run_workload(
    scenario: Scenario, workload: Workload, policy: str, engine: str = "compressed", *, drain: bool = True
) -> PolicyStats:
    """``policy`` on one given workload (a trace replay), summarised; ``drain`` (default): until the last
    request finished, as a real server drains its queue (False: stop at the trace's window)."""
    result = simulate(scenario, workload, policy, engine, drain=drain)
    run = summarise(result, policy, scenario.config.run.seed, _weights(scenario, workload))
    return PolicyStats(mean=run, per_seed=[run])


def policy_ratio(scenario: Scenario, policy: str, workloads: Sequence[Workload]) -> float:
    """``run_policy(...).mean.max_min_ratio`` on these workloads (one per seed), computing that figure only."""
    return fmean(fair_ratio(simulate(scenario, w, policy), _weights(scenario, w)) for w in workloads)


def _weights(scenario: Scenario, workload: Workload) -> dict[str, float]:
    return {name: scenario.shares[name].weight if name in scenario.shares else 1.0 for name in workload.tenants}


_TENANT_MEANS = ("gpu_ms", "gpu_share", "prefill_ms", "decode_tokens", "requests_finished", "mean_output_tokens")
_RUN_MEANS = (
    "busy_ms",
    "charged_ms",
    "max_min_ratio",
    "jain_index",
    "service_diff_max",
    "service_diff_avg",
    "unfinished",
    "decode_tokens",
    "prefill_fraction",
)


def _means(rows: Sequence[object], names: Sequence[str]) -> dict[str, Any]:
    return {name: fmean(getattr(row, name) for row in rows) for name in names}


def average(runs: list[RunStats]) -> RunStats:
    """Mean of each figure over ``runs`` (same policy, same tenants); timeline of the first run."""
    first = runs[0]
    if len(runs) == 1:
        return first
    tenants = []
    for k, tenant in enumerate(first.tenants):
        rows = [r.tenants[k] for r in runs]
        ttft_ms = {q: fmean(t.ttft_ms[q] for t in rows) for q in ("p50", "p99")}
        tenants.append(TenantStats(name=tenant.name, ttft_ms=ttft_ms, **_means(rows, _TENANT_MEANS)))
    return replace(first, tenants=tenants, **_means(runs, _RUN_MEANS))
