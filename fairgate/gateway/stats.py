"""Rolling per-tenant statistics of the gateway's events, for ``/metrics`` and the dashboard.

``Stats`` is an observer (``fairgate.gateway.observe``) that keeps, per tenant (its real name; the views
decide what to show and how to label it):

- cumulative totals since the gateway started (``TenantTotals``): admissions, rejections by reason,
  requests finished by outcome, billed input/output tokens, GPU ms charged, reserved vs settled GPU ms and
  output tokens;
- sliding-window figures (``Stats.window()``, default the last 60 s): GPU ms charged per tenant and model
  (from ``Charged``: the live meter's ``dt / B`` shares as booked with the policy), each tenant's share of
  the GPU time charged in its model's pool, the largest and smallest share, max/min and Jain's index over
  *weighted* shares among the tenants active in the window (those charged any GPU time in it; the
  definitions of ``fairgate.core.fairness``), the VTC paper's service difference over the window
  (``core.fairness.service_gap``, tokens/s, over the requests finished: a request's arrival and first token
  are worked back from its finish, its queue time, TTFT and TPOT; requests still waiting are not in it, so
  it is a lower bound when requests wait longer than the window), p99 queue time, TTFT and TPOT,
  reservation-vs-settlement gaps, and per upstream its busy fraction (from the live meter's integrated busy
  time) and an estimate of its decode iterations per second;
- a bounded time series of samples (``Stats.samples``, one every ``sample_every_s``) for the dashboard.

Sources and units: times are seconds (``_s``) or milliseconds (``_ms``) as named; ``time_s`` stamps are the
events' wall-clock seconds; GPU time is milliseconds of upstream busy time attributed to a tenant. A
tenant that asks for less than its fair share shows a small share: the max/min and Jain figures judge the
scheduler only while the tenants compared are backlogged (as in the simulator's study).

Cost: ``Charged`` arrives once per output token; it costs two dictionary updates here. The window figures
are computed when asked (``window()``: a scrape, a dashboard poll) or every ``sample_every_s`` (a sample);
samples are taken lazily, on the next event or read after they fall due, so no task or timer is needed.

Pure apart from its two inputs: ``clock`` (seconds; the events' ``time_s`` must be on the same clock) and
``probe`` (the dispatcher's and meters' state now; ``gateway_probe`` reads a gateway's). A gateway app
builds one ``Stats`` and shares it between its views (metrics, dashboard).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from fairgate.core.fairness import RequestSpans, gpu_shares, jain_index, max_min_ratio, service_gap, weighted
from fairgate.gateway.dispatch import Dispatcher
from fairgate.gateway.observe import Admitted, Charged, Dispatched, Event, Finished, Rejected
from fairgate.gateway.upstream import UpstreamClient
from fairgate.ledger import Usage

WINDOW_S = 60.0
SAMPLE_EVERY_S = 2.0
MAX_SAMPLES = 180  # 6 minutes at one sample per 2 s; longer history belongs to Prometheus
BUCKET_S = 1.0  # resolution of the sliding window's sums
# Latencies kept for the window's p99s (beyond these, the p99 is that of the most recent ones): bounds memory
# under a flood, at most ~2000 x 3 kinds x 100 bytes = 0.6 MB per tenant.
MAX_LATENCIES = 2_000  # per tenant and kind
MAX_POOL_LATENCIES = 20_000  # per model and kind


@dataclass(frozen=True)
class UpstreamProbe:
    """One upstream now: requests in flight, its slots, the live meter's cumulative busy ms, and whether it
    takes requests (``healthy``: not marked down, nor taken out by a reload and draining)."""

    name: str
    model: str
    in_flight: int
    max_batch: int
    busy_ms: float
    healthy: bool = True
    step_drift: float | None = None  # observed / predicted decode step time (``fairgate.core.drift``)
    engine_running: float | None = None  # the engine's own counts (``fairgate.gateway.engine_load``)
    engine_waiting: float | None = None


@dataclass(frozen=True)
class Probe:
    """The gateway's state now: sequences holding a slot and requests queued per tenant, the upstreams."""

    running: Mapping[str, int] = field(default_factory=dict)
    queued: Mapping[str, int] = field(default_factory=dict)
    upstreams: Sequence[UpstreamProbe] = ()


@dataclass
class TenantTotals:
    """One tenant's cumulative figures since the gateway started.

    ``gpu_ms`` is what the live meter charged (``Charged``, all models); ``billed`` what finished requests
    billed (``Finished``) and ``reserved_output_tokens`` / ``reserved_gpu_ms`` what they had reserved
    (``max_tokens``, the GPU ms estimate); ``overage_gpu_ms`` the billed GPU ms above the estimate.
    A request refused after admission (queue full, no upstream) counts in both admissions and rejections.
    """

    admissions: int = 0
    rejections: dict[str, int] = field(default_factory=dict)
    dispatched: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    gpu_ms: float = 0.0
    billed: Usage = field(default_factory=Usage)
    reserved_output_tokens: int = 0
    reserved_gpu_ms: float = 0.0
    overage_gpu_ms: float = 0.0
    spend_micros: float = 0.0  # what finished requests cost (``Finished.spend_micros``)

    @property
    def rejected(self) -> int:
        return sum(self.rejections.values())

    def counts(self) -> tuple[int, int, int, int]:
        """Admissions, rejections, billed input and output tokens: the counters a sample shows the rates of."""
        return self.admissions, self.rejected, self.billed.input_tokens, self.billed.output_tokens


@dataclass(frozen=True)
class TenantWindow:
    """One tenant over the window: counts, billed tokens, GPU ms charged, p99 latencies (None: no data),
    the reservation-vs-settlement gaps (reserved minus billed, for requests finished in the window;
    negative when metered GPU time exceeded the estimate), and its sequences running / queued now."""

    gpu_ms: float
    gpu_share: float | None  # of the GPU time charged in the window, all pools
    capacity_share: float | None  # of the upstreams' capacity (span x upstreams)
    admissions: int
    rejections: dict[str, int]
    input_tokens: int
    output_tokens: int
    queue_p99_ms: float | None
    ttft_p99_ms: float | None
    tpot_p99_ms: float | None
    reserve_gap_gpu_ms: float
    reserve_gap_output_tokens: int
    running: int
    queued: int

    @property
    def rejected(self) -> int:
        return sum(self.rejections.values())


@dataclass(frozen=True)
class PoolWindow:
    """One model's pool over the window: GPU ms per active tenant, shares (0-1), the largest and smallest
    share, max/min and Jain's index over weighted shares (None: no tenant active), pool p99 TTFT and queue."""

    model: str
    gpu_ms: dict[str, float]
    shares: dict[str, float]
    max_share: float | None
    min_share: float | None
    max_min: float | None
    jain: float | None
    ttft_p99_ms: float | None
    queue_p99_ms: float | None
    service_diff_per_s: float | None = None  # VTC paper's figure, tokens/s (None: no request finished)


@dataclass(frozen=True)
class UpstreamWindow:
    """One upstream: in flight now, its busy fraction over about the window (from its live meter), and an
    estimate of its decode iterations per second: busy fraction x 1000 / mean TPOT ms of the requests it
    finished in the window (a running sequence gets one token per iteration). None: not enough data."""

    name: str
    model: str
    in_flight: int
    max_batch: int
    busy_ms: float
    busy_fraction: float | None
    iterations_per_s: float | None
    healthy: bool = True
    step_drift: float | None = None  # observed / predicted decode step time; None: too few steps yet
    engine_running: float | None = None  # the engine's own counts, where it reports them
    engine_waiting: float | None = None


@dataclass(frozen=True)
class Window:
    """Everything over ``[now_s - span_s, now_s]`` (``span_s`` is the window, or less just after start)."""

    now_s: float
    span_s: float
    tenants: dict[str, TenantWindow]
    pools: dict[str, PoolWindow]
    upstreams: list[UpstreamWindow]


class TenantPoint(NamedTuple):
    """One tenant in one sample. Rates are per second over the interval since the previous sample; shares,
    p99s and gaps are over the window; ``gpu_s`` is cumulative."""

    gpu_share: float | None
    capacity_share: float | None
    queue_p99_ms: float | None
    ttft_p99_ms: float | None
    admissions_per_s: float
    rejections_per_s: float
    running: int
    queued: int
    input_tokens_per_s: float
    output_tokens_per_s: float
    gpu_s: float
    reserve_gap_gpu_s: float
    reserve_gap_output_tokens: int


class _Span(NamedTuple):
    """A finished request, for the service difference: times are seconds on the events' clock."""

    tenant: str
    arrival_s: float
    first_token_s: float
    finish_s: float
    input_tokens: int
    output_tokens: int


class PoolPoint(NamedTuple):
    """One model's pool in one sample (over the window)."""

    max_min: float | None
    jain: float | None
    ttft_p99_ms: float | None
    queue_p99_ms: float | None


class Sample(NamedTuple):
    """The dashboard's time series point taken at ``t_s``."""

    t_s: float
    tenants: dict[str, TenantPoint]
    pools: dict[str, PoolPoint]
    busy: dict[str, float | None]  # upstream -> busy fraction over the window


class _Buckets:
    """Sums per key in ``bucket_s`` time buckets: add O(1), sum over a window O(buckets x keys)."""

    __slots__ = ("_buckets", "_current", "_index", "bucket_s")

    def __init__(self, bucket_s: float) -> None:
        self.bucket_s = bucket_s
        self._buckets: deque[tuple[int, dict[Any, float]]] = deque()
        self._index: int | None = None
        self._current: dict[Any, float] = {}

    def add(self, time_s: float, key: Hashable, amount: float) -> None:
        index = int(time_s // self.bucket_s)
        if index != self._index:
            if self._index is not None and index < self._index:
                index = self._index  # a clock step backwards: book it in the newest bucket
            else:
                self._index = index
                self._current = {}
                self._buckets.append((index, self._current))
        current = self._current
        current[key] = current.get(key, 0.0) + amount

    def expire(self, since_s: float) -> None:
        """Drop the buckets that end at or before ``since_s``."""
        while self._buckets and (self._buckets[0][0] + 1) * self.bucket_s <= since_s:
            self._buckets.popleft()

    def totals(self, since_s: float) -> dict[Any, float]:
        """Sums over the buckets that end after ``since_s``."""
        self.expire(since_s)
        total: dict[Any, float] = {}
        for _, bucket in self._buckets:
            for key, amount in bucket.items():
                total[key] = total.get(key, 0.0) + amount
        return total


def p99(values: Iterable[float]) -> float | None:
    """The 99th percentile (nearest rank) of ``values``; None when empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


class Stats:
    """The rolling aggregator (see module docstring).

    Args:
        probe: the gateway's state now (``Probe``); None: nothing is running and there are no upstreams.
        weights: tenant -> weight for max/min and Jain (absent: 1).
        clock: seconds, the clock of the events' ``time_s`` (wall clock in the gateway).
        window_s: the sliding window of shares, percentiles and gaps.
        sample_every_s: the dashboard's sampling interval; ``max_samples`` bounds the series kept.
    """

    def __init__(
        self,
        probe: Callable[[], Probe] | None = None,
        weights: Mapping[str, float] | None = None,
        clock: Callable[[], float] = time.time,
        window_s: float = WINDOW_S,
        sample_every_s: float = SAMPLE_EVERY_S,
        max_samples: int = MAX_SAMPLES,
        bucket_s: float = BUCKET_S,
    ) -> None:
        if not (window_s > 0 and sample_every_s > 0 and max_samples >= 1 and bucket_s > 0):
            raise ValueError("window_s, sample_every_s, bucket_s must be > 0 and max_samples >= 1")
        self._probe = probe or Probe
        self.weights = dict(weights or {})
        self.clock = clock
        self.window_s = window_s
        self.sample_every_s = sample_every_s
        self.started_s = clock()
        self.totals: dict[str, TenantTotals] = {}
        self.unattributed_rejections: dict[str, int] = {}  # no valid credential: nobody to attribute it to
        self.samples: deque[Sample] = deque(maxlen=max_samples)
        self._gpu = _Buckets(bucket_s)  # (tenant, model) -> GPU ms charged
        self._counts = _Buckets(bucket_s)  # (tenant, field) -> count or amount
        self._rejects = _Buckets(bucket_s)  # (tenant, reason) -> count
        self._tpot = _Buckets(bucket_s)  # (upstream, "sum" | "n")
        self._latency: dict[tuple[str, str], deque[tuple[float, float]]] = {}  # (kind, tenant) -> (time_s, ms)
        self._pool_latency: dict[tuple[str, str], deque[tuple[float, float]]] = {}  # (kind, model) -> ...
        self._spans: dict[str, deque[_Span]] = {}  # model -> finished requests, for the service difference
        self._busy: deque[tuple[float, dict[str, float]]] = deque()  # (time_s, upstream -> busy ms)
        self._last_sample_s: float | None = None
        self._previous: dict[str, tuple[int, int, int, int]] = {}  # tenant -> cumulative counts at last sample
        self.on_sample: Callable[[Sample], None] | None = None  # told of each sample taken (the history file)

    # -- events ---------------------------------------------------------------------------------------------

    def observe(self, event: Event) -> None:
        """Take one event (an ``Observer``); may take a sample if one is due."""
        if type(event) is Charged:  # the hot path: once per token
            totals = self.totals.get(event.tenant)
            if totals is None:
                totals = self.totals[event.tenant] = TenantTotals()
            totals.gpu_ms += event.gpu_ms
            self._gpu.add(event.time_s, (event.tenant, event.model), event.gpu_ms)
            return
        if isinstance(event, Rejected):
            if event.tenant is None:
                self.unattributed_rejections[event.reason] = self.unattributed_rejections.get(event.reason, 0) + 1
            else:
                totals = self._tenant(event.tenant)
                totals.rejections[event.reason] = totals.rejections.get(event.reason, 0) + 1
                self._rejects.add(event.time_s, (event.tenant, event.reason), 1)
        elif isinstance(event, Admitted):
            self._tenant(event.tenant).admissions += 1
            self._counts.add(event.time_s, (event.tenant, "admissions"), 1)
        elif isinstance(event, Dispatched):
            self._tenant(event.tenant).dispatched += 1
            self._remember("queue", event.tenant, event.model, event.time_s, event.queue_ms)
        elif isinstance(event, Finished):
            self._finished(event)
        self.tick()

    def _tenant(self, tenant: str) -> TenantTotals:
        totals = self.totals.get(tenant)
        if totals is None:
            totals = self.totals[tenant] = TenantTotals()
        return totals

    def _remember(self, kind: str, tenant: str, model: str | None, time_s: float, value_ms: float) -> None:
        _append(self._latency, (kind, tenant), time_s, value_ms, MAX_LATENCIES)
        if model is not None:
            _append(self._pool_latency, (kind, model), time_s, value_ms, MAX_POOL_LATENCIES)

    def _finished(self, e: Finished) -> None:
        totals = self._tenant(e.tenant)
        totals.finished[e.outcome] = totals.finished.get(e.outcome, 0) + 1
        b = totals.billed
        totals.billed = Usage(b.input_tokens + e.input_tokens, b.output_tokens + e.output_tokens, b.gpu_ms + e.gpu_ms)
        totals.reserved_output_tokens += e.max_output_tokens
        totals.reserved_gpu_ms += e.gpu_ms_estimate
        totals.overage_gpu_ms += max(0.0, e.gpu_ms - e.gpu_ms_estimate)
        totals.spend_micros += e.spend_micros
        add = self._counts.add
        add(e.time_s, (e.tenant, "input_tokens"), e.input_tokens)
        add(e.time_s, (e.tenant, "output_tokens"), e.output_tokens)
        add(e.time_s, (e.tenant, "gap_gpu_ms"), e.gpu_ms_estimate - e.gpu_ms)
        add(e.time_s, (e.tenant, "gap_output_tokens"), e.max_output_tokens - e.output_tokens)
        if e.ttft_ms is not None:
            # What the client waited: its time in the queue, then to the first token (the SLO's TTFT).
            self._remember("ttft", e.tenant, e.model, e.time_s, e.queue_ms + e.ttft_ms)
        if e.ttft_ms is not None and e.output_tokens > 0:
            spans = self._spans.setdefault(e.model, deque(maxlen=MAX_POOL_LATENCIES))
            first_s = e.time_s - (e.tpot_ms or 0.0) * (e.output_tokens - 1) / 1000.0
            arrival_s = first_s - (e.queue_ms + e.ttft_ms) / 1000.0
            spans.append(_Span(e.tenant, arrival_s, first_s, e.time_s, e.input_tokens, e.output_tokens))
        if e.tpot_ms is not None:
            self._remember("tpot", e.tenant, None, e.time_s, e.tpot_ms)
            self._tpot.add(e.time_s, (e.upstream, "sum"), e.tpot_ms)
            self._tpot.add(e.time_s, (e.upstream, "n"), 1)

    # -- reading --------------------------------------------------------------------------------------------

    @staticmethod
    def _p99(table: dict[tuple[str, str], deque[tuple[float, float]]], key: tuple[str, str]) -> float | None:
        values = table.get(key)
        return p99(v for _, v in values) if values else None

    def window(self, probe: Probe | None = None, now: float | None = None) -> Window:
        """The figures over the sliding window ending ``now`` (default: the clock; ``probe``: default a fresh
        one)."""
        now = self.clock() if now is None else now
        probe = probe if probe is not None else self._probe()
        since = now - self.window_s
        span = max(1e-9, min(self.window_s, now - self.started_s))
        _prune(self._latency, since)
        _prune(self._pool_latency, since)
        for spans in self._spans.values():
            while spans and spans[0].finish_s < since:
                spans.popleft()
        pools, per_tenant_gpu = self._pools(since, probe)
        tenants = self._tenants(since, span, probe, per_tenant_gpu)
        return Window(now, span, tenants, pools, self._upstreams(since, now, probe))

    def _pools(self, since: float, probe: Probe) -> tuple[dict[str, PoolWindow], dict[str, float]]:
        """Per model: GPU ms per tenant, shares, fairness figures; and GPU ms per tenant over all models."""
        per_model: dict[str, dict[str, float]] = {}
        per_tenant_gpu: dict[str, float] = {}
        for (tenant, model), ms in self._gpu.totals(since).items():
            if ms > 0:
                per_model.setdefault(model, {})[tenant] = ms
                per_tenant_gpu[tenant] = per_tenant_gpu.get(tenant, 0.0) + ms
        models = set(per_model) | {u.model for u in probe.upstreams}
        pools = {}
        for model in sorted(models):
            gpu = per_model.get(model, {})
            shares = gpu_shares(gpu, sum(gpu.values())) if gpu else {}
            fair = weighted(shares, self.weights)
            pools[model] = PoolWindow(
                model,
                gpu,
                shares,
                max(shares.values()) if shares else None,
                min(shares.values()) if shares else None,
                max_min_ratio(fair) if fair else None,
                jain_index(fair) if fair else None,
                self._p99(self._pool_latency, ("ttft", model)),
                self._p99(self._pool_latency, ("queue", model)),
                self._service_gap(model, since),
            )
        return pools, per_tenant_gpu

    def _service_gap(self, model: str, since: float) -> float | None:
        """The pool's service difference over ``[since, since + window_s]`` (None: no request finished)."""
        spans = self._spans.get(model)
        if not spans:
            return None
        names = sorted({span.tenant for span in spans})
        index = {name: k for k, name in enumerate(names)}
        columns = RequestSpans()
        for span in spans:
            columns.add(index[span.tenant], *span[1:])
        weights = [self.weights.get(name, 1.0) for name in names]
        return service_gap(columns, len(names), since, since + self.window_s, tenant_weights=weights)

    def _tenants(
        self, since: float, span: float, probe: Probe, per_tenant_gpu: dict[str, float]
    ) -> dict[str, TenantWindow]:
        counts = self._counts.totals(since)
        rejects: dict[str, dict[str, int]] = {}
        for (tenant, reason), n in self._rejects.totals(since).items():
            rejects.setdefault(tenant, {})[reason] = int(n)
        total_gpu = sum(per_tenant_gpu.values())
        capacity_ms = span * 1000.0 * len(probe.upstreams)
        names = (
            {t for t, _ in counts}
            | set(rejects)
            | set(per_tenant_gpu)
            | {t for t, n in probe.running.items() if n}
            | {t for t, n in probe.queued.items() if n}
        )
        tenants = {}
        for tenant in sorted(names):
            gpu_ms = per_tenant_gpu.get(tenant, 0.0)
            tenants[tenant] = TenantWindow(
                gpu_ms,
                gpu_ms / total_gpu if total_gpu > 0 else None,
                gpu_ms / capacity_ms if capacity_ms > 0 else None,
                int(counts.get((tenant, "admissions"), 0)),
                rejects.get(tenant, {}),
                int(counts.get((tenant, "input_tokens"), 0)),
                int(counts.get((tenant, "output_tokens"), 0)),
                self._p99(self._latency, ("queue", tenant)),
                self._p99(self._latency, ("ttft", tenant)),
                self._p99(self._latency, ("tpot", tenant)),
                counts.get((tenant, "gap_gpu_ms"), 0.0),
                int(counts.get((tenant, "gap_output_tokens"), 0)),
                int(probe.running.get(tenant, 0)),
                int(probe.queued.get(tenant, 0)),
            )
        return tenants

    def _upstreams(self, since: float, now: float, probe: Probe) -> list[UpstreamWindow]:
        """Busy fraction against the oldest busy snapshot within (about) the window."""
        while len(self._busy) > 1 and self._busy[1][0] <= since:
            self._busy.popleft()
        reference = self._busy[0] if self._busy else None
        tpot = self._tpot.totals(since)
        upstreams = []
        for u in probe.upstreams:
            busy = iterations = None
            if reference is not None and now > reference[0] and u.name in reference[1]:
                busy = (u.busy_ms - reference[1][u.name]) / ((now - reference[0]) * 1000.0)
                busy = min(1.0, max(0.0, busy))
                n = tpot.get((u.name, "n"), 0.0)
                if n > 0:
                    iterations = busy * 1000.0 / (tpot[(u.name, "sum")] / n)
            window = UpstreamWindow(
                u.name,
                u.model,
                u.in_flight,
                u.max_batch,
                u.busy_ms,
                busy,
                iterations,
                u.healthy,
                u.step_drift,
                u.engine_running,
                u.engine_waiting,
            )
            upstreams.append(window)
        return upstreams

    def tick(self) -> None:
        """Take a sample if one is due (called on every event but ``Charged``, and by readers)."""
        now = self.clock()
        if self._last_sample_s is None or now - self._last_sample_s >= self.sample_every_s:
            self.sample()

    def sample(self) -> Sample:
        """Take a sample now (normally via ``tick``) and append it to ``samples``."""
        probe = self._probe()
        now = self.clock()
        view = self.window(probe, now)
        self._busy.append((now, {u.name: u.busy_ms for u in probe.upstreams}))
        interval = max(1e-9, now - (self._last_sample_s if self._last_sample_s is not None else self.started_s))
        self._last_sample_s = now
        points = {}
        for tenant, w in view.tenants.items():
            totals = self.totals.get(tenant) or TenantTotals()
            current = totals.counts()
            before = self._previous.get(tenant, (0, 0, 0, 0))
            self._previous[tenant] = current
            rates = [(c - b) / interval for c, b in zip(current, before, strict=True)]
            points[tenant] = TenantPoint(
                w.gpu_share,
                w.capacity_share,
                w.queue_p99_ms,
                w.ttft_p99_ms,
                rates[0],
                rates[1],
                w.running,
                w.queued,
                rates[2],
                rates[3],
                totals.gpu_ms / 1000.0,
                w.reserve_gap_gpu_ms / 1000.0,
                w.reserve_gap_output_tokens,
            )
        for tenant, totals in self.totals.items():  # idle now: keep the next interval's rates right
            if tenant not in view.tenants:
                self._previous[tenant] = totals.counts()
        pools = {m: PoolPoint(p.max_min, p.jain, p.ttft_p99_ms, p.queue_p99_ms) for m, p in view.pools.items()}
        sample = Sample(now, points, pools, {u.name: u.busy_fraction for u in view.upstreams})
        self.samples.append(sample)
        if self.on_sample is not None:
            self.on_sample(sample)
        return sample


def _append(
    table: dict[tuple[str, str], deque[tuple[float, float]]],
    key: tuple[str, str],
    time_s: float,
    value: float,
    limit: int,
) -> None:
    values = table.get(key)
    if values is None:
        values = table[key] = deque(maxlen=limit)
    values.append((time_s, value))


def _prune(table: dict[tuple[str, str], deque[tuple[float, float]]], since_s: float) -> None:
    """Drop the values older than ``since_s``, and the keys left without any."""
    for key in list(table):
        values = table[key]
        while values and values[0][0] < since_s:
            values.popleft()
        if not values:
            del table[key]


def gateway_probe(dispatcher: Dispatcher, clients: Mapping[str, UpstreamClient]) -> Callable[[], Probe]:
    """A ``Probe`` source reading a gateway's dispatcher and its upstream clients' live meters (``clients``
    is read at each call: the gateway fills it when it starts)."""

    def probe() -> Probe:
        ups = [
            UpstreamProbe(
                u.name,
                u.model,
                u.in_flight,
                u.max_batch,
                clients[u.name].meter.busy_ms if u.name in clients else 0.0,
                u.serving,
                clients[u.name].drift.ratio if u.name in clients else None,
                u.engine_running,
                u.engine_waiting,
            )
            for u in dispatcher.upstreams()
        ]
        return Probe(dispatcher.running_by_tenant(), dispatcher.queued_by_tenant(), ups)

    return probe
