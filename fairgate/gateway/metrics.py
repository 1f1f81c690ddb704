"""Prometheus metrics at ``GET /metrics``.

Each app has its own ``CollectorRegistry`` (``app.state.metrics_registry``), so several gateways in one
process (tests, the demo) never collide; nothing is registered on prometheus_client's global registry.

**Access.** ``/metrics`` answers only to an ``[admin]`` key (``Authorization: Bearer <admin key>``; in
Prometheus, ``authorization: {type: Bearer, credentials_file: ...}`` in the scrape config): 401 without a
valid key, 403 with a tenant's key. Even hashed, the series describe every tenant's traffic, and tenants
may only see their own data (seed 003); a gateway without ``[admin] key_hashes`` therefore exposes no
metrics. One rule, no second listener to bind and firewall, and it fails closed.

**Labels.** ``tenant`` is ``fairgate.ledger.base.tenant_tag(tenant)`` (a stable 16-hex-digit hash), never the
name. Cardinality is capped: the first ``TENANT_LABEL_CAP`` (200) tenants get their own label (the
configured tenants first, in file order, then in order of appearance); any further tenant is counted under
``tenant="other"``. Requests without a valid credential are counted under ``tenant="none"``. Rejections
carry no ``model`` label (a client may send any model name); ``model`` labels elsewhere come from the
configuration. With the cap, each histogram has at most 202 x 15 bucket series.

**Metrics** (sources: the request events of ``fairgate.gateway.observe`` and ``fairgate.gateway.stats``):

Per tenant (counters and histograms from events, cumulative since start)

- ``fairgate_admissions_total{tenant,model}``: reservations made (``Admitted``).
- ``fairgate_rejections_total{tenant,reason}``: requests turned away, by ``observe.REJECT_REASONS``
  (``Rejected``; one refused after admission - queue full, no upstream - counts in both).
- ``fairgate_requests_finished_total{tenant,outcome}``: upstream calls ended: completed, cancelled, error
  (an upstream failure answered 502 counts here as ``error`` and in the rejections as ``upstream_error``).
- ``fairgate_requests_left_queued_total{tenant}``: admitted requests whose client left while queued (``Left``:
  never run, nothing billed). Every admission ends in one of these two counters or in a rejection after
  admission (queue full, no upstream).
- ``fairgate_queue_time_seconds{tenant}``: histogram, time in the tenant's queue before each dispatch (a request
  an upstream refused the connection to goes back to the queue, and is dispatched, and counted, again).
- ``fairgate_ttft_seconds{tenant}``, ``fairgate_tpot_seconds{tenant}``: histograms, admission (queue
  included) to first token, mean time per output token after the first (``Finished``).
- ``fairgate_input_tokens_total{tenant}``, ``fairgate_output_tokens_total{tenant}``: billed tokens (the
  upstream's usage, ``Finished``).
- ``fairgate_gpu_seconds_total{tenant,model}``: GPU seconds charged by the live meter as booked with the
  policy (``Charged``; the prefill estimate at dispatch, then metered time beyond it).
- ``fairgate_settled_gpu_seconds_total{tenant}`` / ``fairgate_reserved_gpu_seconds_total{tenant}``: GPU
  seconds billed to and reserved in the ledger by finished requests; ``fairgate_overage_gpu_seconds_total``
  the part billed above the estimate; ``fairgate_reserved_output_tokens_total{tenant}`` the ``max_tokens``
  reserved. Reservation-vs-settlement difference = reserved - settled (GPU s), reserved output tokens -
  ``fairgate_output_tokens_total`` (tokens).
- ``fairgate_cached_input_tokens_total{tenant}``: prompt tokens the engine read from its prefix cache (its
  usage's ``prompt_tokens_details.cached_tokens``); ``fairgate_prefix_cache_credit_gpu_seconds_total{tenant}``:
  the GPU seconds the meter had charged for their prefill, taken off the tenant's bills and booked in the
  policy to the tenants that ran beside them (``fairgate.core.prefix_cache``). Billed + credited = busy.
- ``fairgate_active_sequences{tenant}``, ``fairgate_queued_requests{tenant}``: gauges, now (dispatcher).
- ``fairgate_gpu_share_ratio{tenant,model}``: gauge, the tenant's share (0-1) of the GPU time charged in
  the model's pool over the sliding window (``stats.WINDOW_S``, 60 s).

Per upstream

- ``fairgate_upstream_up{upstream,model}``: 1 while it takes requests, 0 while marked down (it refused a
  connection; the probe marks it up when it answers again; both are logged) or draining (a reload took it
  out; its series goes once its requests end).
- ``fairgate_upstream_in_flight{upstream,model}``: requests in flight now.
- ``fairgate_upstream_busy_seconds_total{upstream,model}``: the live meter's busy time (any request in flight).
- ``fairgate_upstream_busy_ratio{upstream,model}``: busy fraction over about the window.
- ``fairgate_upstream_iterations_per_second{upstream,model}``: estimate, busy fraction / mean TPOT.
- ``fairgate_upstream_engine_running{upstream,model}``, ``fairgate_upstream_engine_waiting{...}``: the engine's
  own counts where its kind reports them (``fairgate.gateway.engine_load``).
- ``fairgate_upstream_step_drift_ratio{upstream,model}``: observed / cost-model decode step time
  (``fairgate.core.drift``; a ``cost_model_drift`` warning when it leaves [0.8, 1.25], once per excursion).
- ``fairgate_upstream_batch_mismatch{upstream,model}``: 1 while the engine's running count and the meter's
  batch size disagree (by more than max(2, 25 %) on 4 reads in a row: another client shares the engine, or
  ``max_batch`` is above its slots, and the meter's ``dt / B`` shares are off), else 0; where the kind reports
  its load (``fairgate.gateway.engine_load``, which registers it; a ``batch_size_mismatch`` warning once per
  episode).

Per policy and model (over the window, among tenants charged GPU time in it)

- ``fairgate_gpu_share_max_ratio``, ``fairgate_gpu_share_min_ratio``: the largest and smallest share.
- ``fairgate_gpu_share_max_over_min``: max/min of weighted shares (1.0 fair; ``+Inf`` never, the minimum is
  over tenants with a positive share); ``fairgate_jain_index``: Jain's index of weighted shares.
- ``fairgate_service_difference_tokens_per_second``: the VTC paper's fairness figure (Sheng et al., OSDI
  2024) over the window: the tenants' summed gaps in token service rate (input + 2 x output tokens) to the
  best-served one, each capped by its unmet demand (``core.fairness.service_gap``; over requests finished).
- ``fairgate_active_tenants``: how many tenants these figures compare.

Cost: a ``Charged`` event (one per output token) is one dictionary look-up and one counter increment here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import anyio
from fastapi import Depends, FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fairgate.gateway.config import GatewayConfig
from fairgate.gateway.identity import require_admin
from fairgate.gateway.observe import Admitted, Charged, Dispatched, Event, Fanout, Finished, Left, Rejected
from fairgate.gateway.stats import Stats, Window
from fairgate.ledger.base import tenant_tag

TENANT_LABEL_CAP = 200
OVERFLOW_LABEL = "other"
UNAUTHENTICATED_LABEL = "none"

QUEUE_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0)
TPOT_BUCKETS_S = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class TenantLabels:
    """Tenant -> ``tenant`` label value: its hash for the first ``cap`` tenants, then ``"other"``;
    ``None`` (no valid credential) -> ``"none"``. ``tenants`` are registered first, in order."""

    def __init__(self, cap: int = TENANT_LABEL_CAP, tenants: Iterable[str] = ()) -> None:
        if cap < 0:
            raise ValueError("cap must be >= 0")
        self.cap = cap
        self._labels: dict[str, str] = {}
        for tenant in tenants:
            self(tenant)

    def __call__(self, tenant: str | None) -> str:
        if tenant is None:
            return UNAUTHENTICATED_LABEL
        label = self._labels.get(tenant)
        if label is None:
            if len(self._labels) >= self.cap:
                return OVERFLOW_LABEL
            label = self._labels[tenant] = tenant_tag(tenant)
        return label

    def labelled(self) -> list[str]:
        """The label values given to tenants so far (hashes; neither "other" nor "none")."""
        return list(self._labels.values())


class MetricsObserver:
    """Turns request events into counters and histograms on ``registry`` (see module docstring)."""

    def __init__(self, registry: CollectorRegistry, labels: TenantLabels) -> None:
        self.labels = labels

        def counter(name: str, text: str, *labels: str) -> Counter:
            return Counter(name, text, ["tenant", *labels], registry=registry)

        def histogram(name: str, text: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, text, ["tenant"], buckets=buckets, registry=registry)

        self.admissions = counter("fairgate_admissions", "Requests admitted (a ledger reservation was made).", "model")
        self.rejections = counter("fairgate_rejections", "Requests turned away, by reason.", "reason")
        self.finished = counter("fairgate_requests_finished", "Upstream calls ended, by outcome.", "outcome")
        self.left_queued = counter(
            "fairgate_requests_left_queued",
            "Admitted requests whose client left while they were queued: never run, nothing billed.",
        )
        self.queue_time = histogram(
            "fairgate_queue_time_seconds", "Time in the tenant's queue before dispatch.", QUEUE_BUCKETS_S
        )
        self.ttft = histogram(
            "fairgate_ttft_seconds", "Time from admission (queue included) to the first output token.", TTFT_BUCKETS_S
        )
        self.tpot = histogram(
            "fairgate_tpot_seconds", "Mean time per output token after the first, per request.", TPOT_BUCKETS_S
        )
        self.input_tokens = counter("fairgate_input_tokens", "Input (prompt) tokens billed.")
        self.output_tokens = counter("fairgate_output_tokens", "Output tokens billed.")
        self.gpu_seconds = counter(
            "fairgate_gpu_seconds", "GPU seconds charged by the live meter (dt/B shares).", "model"
        )
        self.settled_gpu = counter("fairgate_settled_gpu_seconds", "GPU seconds billed by finished requests.")
        self.reserved_gpu = counter("fairgate_reserved_gpu_seconds", "GPU seconds reserved by finished requests.")
        self.overage_gpu = counter(
            "fairgate_overage_gpu_seconds", "GPU seconds billed above the reservation's estimate."
        )
        self.reserved_output = counter(
            "fairgate_reserved_output_tokens", "Output tokens reserved (max_tokens) by finished requests."
        )
        self.cached_input = counter(
            "fairgate_cached_input_tokens", "Prompt tokens the engine read from its prefix cache (its usage)."
        )
        self.cache_credit = counter(
            "fairgate_prefix_cache_credit_gpu_seconds",
            "GPU seconds of prefill the engine's prefix cache spared, taken off the tenant's bills.",
        )
        self._gpu_children: dict[tuple[str, str], Any] = {}
        self._children: dict[tuple[Any, ...], Any] = {}  # (metric, label values) -> its child (``_child``)
        self.window: WindowCollector | None = None  # set by ``build``
        self._handlers = {
            Charged: self._charged,
            Admitted: self._admitted,
            Rejected: self._rejected,
            Dispatched: self._dispatched,
            Finished: self._finished,
            Left: self._left,
        }

    def observe(self, event: Event) -> None:
        handler = self._handlers.get(type(event))
        if handler is not None:
            handler(event)  # type: ignore[operator]

    def _charged(self, e: Charged) -> None:
        child = self._gpu_children.get((e.tenant, e.model))
        if child is None:
            child = self._gpu_children[(e.tenant, e.model)] = self.gpu_seconds.labels(self.labels(e.tenant), e.model)
        child.inc(e.gpu_ms / 1000.0)

    def _child(self, metric: Counter | Histogram, *values: str) -> Any:
        """``metric.labels(*values)``, kept: prometheus-client checks the values and takes a lock on every
        ``labels`` call (ten of them a request were 1 % of the gateway's CPU per request)."""
        key = (metric, *values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def _admitted(self, e: Admitted) -> None:
        self._child(self.admissions, self.labels(e.tenant), e.model).inc()

    def _rejected(self, e: Rejected) -> None:
        self._child(self.rejections, self.labels(e.tenant), e.reason).inc()

    def _dispatched(self, e: Dispatched) -> None:
        self._child(self.queue_time, self.labels(e.tenant)).observe(e.queue_ms / 1000.0)

    def _left(self, e: Left) -> None:
        self._child(self.left_queued, self.labels(e.tenant)).inc()

    def _finished(self, e: Finished) -> None:
        label, child = self.labels(e.tenant), self._child
        child(self.finished, label, e.outcome).inc()
        if e.ttft_ms is not None:
            child(self.ttft, label).observe((e.queue_ms + e.ttft_ms) / 1000.0)
        if e.tpot_ms is not None:
            child(self.tpot, label).observe(e.tpot_ms / 1000.0)
        child(self.input_tokens, label).inc(e.input_tokens)
        child(self.output_tokens, label).inc(e.output_tokens)
        child(self.settled_gpu, label).inc(e.gpu_ms / 1000.0)
        child(self.reserved_gpu, label).inc(e.gpu_ms_estimate / 1000.0)
        child(self.overage_gpu, label).inc(max(0.0, e.gpu_ms - e.gpu_ms_estimate) / 1000.0)
        child(self.reserved_output, label).inc(e.max_output_tokens)
        if e.cached_tokens:
            child(self.cached_input, label).inc(e.cached_tokens)
        if e.cache_credit_gpu_ms > 0:  # a counter: a correction the other way (none today) is not its to show
            child(self.cache_credit, label).inc(e.cache_credit_gpu_ms / 1000.0)


class WindowCollector(Collector):
    """Gauges read at scrape time from ``Stats.window()``: sequences, shares, fairness, upstreams.

    ``prepare()`` computes them (on the event loop, where the observers run); ``collect()`` then yields what
    was prepared, so the exposition text can be rendered in a worker thread. Without ``prepare()`` (a direct
    ``registry.collect()``), ``collect()`` computes them itself.
    """

    def __init__(self, stats: Stats, labels: TenantLabels, policy: str) -> None:
        self.stats, self.labels, self.policy = stats, labels, policy
        self._prepared: list[Metric] | None = None

    def prepare(self) -> None:
        self._prepared = list(self._families())

    def collect(self) -> Iterator[Metric]:
        prepared, self._prepared = self._prepared, None
        return iter(prepared if prepared is not None else list(self._families()))

    def _families(self) -> Iterator[Metric]:
        view = self.stats.window()
        yield from self._tenant_families(view)
        yield from self._pool_families(view)
        yield from self._upstream_families(view)

    def _tenant_families(self, view: Window) -> Iterator[Metric]:
        running: dict[str, float] = dict.fromkeys(self.labels.labelled(), 0.0)
        queued = dict(running)
        for tenant, w in view.tenants.items():
            label = self.labels(tenant)
            running[label] = running.get(label, 0.0) + w.running
            queued[label] = queued.get(label, 0.0) + w.queued
        yield _gauge(
            "fairgate_active_sequences",
            "Sequences holding an upstream slot now.",
            ["tenant"],
            [((k,), v) for k, v in running.items()],
        )
        yield _gauge(
            "fairgate_queued_requests",
            "Requests waiting in the tenant's queue now.",
            ["tenant"],
            [((k,), v) for k, v in queued.items()],
        )

    def _pool_families(self, view: Window) -> Iterator[Metric]:
        shares: dict[tuple[str, str], float] = {}
        for model, pool in view.pools.items():
            for tenant, share in pool.shares.items():
                key = (self.labels(tenant), model)
                shares[key] = shares.get(key, 0.0) + share
        yield _gauge(
            "fairgate_gpu_share_ratio",
            f"Share of the pool's GPU time charged in the last {self.stats.window_s:g} s.",
            ["tenant", "model"],
            shares.items(),
        )
        fairness = [
            ("fairgate_gpu_share_max_ratio", "Largest tenant GPU share in the window.", "max_share"),
            ("fairgate_gpu_share_min_ratio", "Smallest tenant GPU share in the window.", "min_share"),
            ("fairgate_gpu_share_max_over_min", "Max/min of weighted GPU shares in the window.", "max_min"),
            ("fairgate_jain_index", "Jain's index of weighted GPU shares in the window.", "jain"),
            (
                "fairgate_service_difference_tokens_per_second",
                "The VTC paper's service difference over the window (tokens/s, over the requests finished).",
                "service_diff_per_s",
            ),
        ]
        for name, text, attribute in fairness:
            yield _gauge(
                name,
                text,
                ["policy", "model"],
                (
                    ((self.policy, m), getattr(p, attribute))
                    for m, p in view.pools.items()
                    if getattr(p, attribute) is not None
                ),
            )
        yield _gauge(
            "fairgate_active_tenants",
            "Tenants charged GPU time in the window (compared by the share figures).",
            ["policy", "model"],
            (((self.policy, m), len(p.shares)) for m, p in view.pools.items()),
        )

    def _upstream_families(self, view: Window) -> Iterator[Metric]:
        ups = view.upstreams
        yield _gauge(
            "fairgate_upstream_up",
            "1 while the upstream takes requests, 0 while it is marked down (refused a connection) or drains (a "
            "reload took it out).",
            ["upstream", "model"],
            (((u.name, u.model), 1.0 if u.healthy else 0.0) for u in ups),
        )
        yield _gauge(
            "fairgate_upstream_in_flight",
            "Requests in flight on the upstream now.",
            ["upstream", "model"],
            (((u.name, u.model), u.in_flight) for u in ups),
        )
        busy = CounterMetricFamily(
            "fairgate_upstream_busy_seconds",
            "Time with at least one request in flight (the live meter).",
            labels=["upstream", "model"],
        )
        for u in ups:
            busy.add_metric([u.name, u.model], u.busy_ms / 1000.0)
        yield busy
        yield _gauge(
            "fairgate_upstream_busy_ratio",
            f"Busy fraction over about the last {self.stats.window_s:g} s.",
            ["upstream", "model"],
            (((u.name, u.model), u.busy_fraction) for u in ups if u.busy_fraction is not None),
        )
        yield _gauge(
            "fairgate_upstream_step_drift_ratio",
            "Observed / cost-model decode step time (exponentially weighted over about the last 50 steps); "
            "off 1 by more than 25 %: recalibrate (fairgate calibrate).",
            ["upstream", "model"],
            (((u.name, u.model), u.step_drift) for u in ups if u.step_drift is not None),
        )
        for what, text in (
            ("running", "Requests in the engine's running batch, as the engine reports it (its /metrics)."),
            ("waiting", "Requests queued inside the engine; while any are, the gateway sends it nothing more."),
        ):
            yield _gauge(
                f"fairgate_upstream_engine_{what}",
                text,
                ["upstream", "model"],
                (((u.name, u.model), v) for u in ups if (v := getattr(u, f"engine_{what}")) is not None),
            )
        yield _gauge(
            "fairgate_upstream_iterations_per_second",
            "Estimated decode iterations per second (busy fraction / mean TPOT).",
            ["upstream", "model"],
            (((u.name, u.model), u.iterations_per_s) for u in ups if u.iterations_per_s is not None),
        )


class SnapshotGauge(Collector):
    """A gauge whose values its owner replaces whole, on the event loop (``values``: a tuple of (label
    values, value)); a scrape renders it off the loop (``install``), so it reads one snapshot, never a table
    being changed."""

    def __init__(self, name: str, text: str, labels: list[str]) -> None:
        self.name, self.text, self.labels = name, text, labels
        self.values: tuple[tuple[tuple[str, ...], float], ...] = ()

    def collect(self) -> Iterator[Metric]:
        yield _gauge(self.name, self.text, self.labels, self.values)


def batch_mismatch_gauge() -> SnapshotGauge:
    """``fairgate_upstream_batch_mismatch{upstream,model}`` (module docstring), for ``engine_load`` to fill."""
    return SnapshotGauge(
        "fairgate_upstream_batch_mismatch",
        "1 while the engine's running count and the gateway's batch size on it disagree (another client shares "
        "the engine, or max_batch is above its slots: the meter's dt / B shares are off).",
        ["upstream", "model"],
    )


def _gauge(name: str, text: str, labels: list[str], values: Iterable[tuple[tuple[str, ...], float]]) -> Metric:
    family = GaugeMetricFamily(name, text, labels=labels)
    for label_values, value in values:
        family.add_metric(list(label_values), float(value))
    return family


def build(
    stats: Stats, tenants: Iterable[str] = (), policy: str = "", cap: int = TENANT_LABEL_CAP
) -> tuple[CollectorRegistry, MetricsObserver]:
    """A fresh registry holding the event metrics (the returned observer) and the window gauges of ``stats``."""
    registry = CollectorRegistry()
    labels = TenantLabels(cap, tenants)
    observer = MetricsObserver(registry, labels)
    observer.window = WindowCollector(stats, labels, policy)
    registry.register(observer.window)
    return registry, observer


def install(app: FastAPI, config: GatewayConfig, stats: Stats, events: Fanout) -> CollectorRegistry:
    """Add the metrics observer to ``events`` and ``GET /metrics`` (admin key; see module docstring) to the
    gateway ``app``; returns the registry."""
    registry, observer = build(stats, config.quotas.tenants, config.gateway.policy)
    window = observer.window
    assert window is not None
    events.add(observer)
    scraping = asyncio.Lock()  # one scrape at a time: each renders the gauges it prepared

    @app.get("/metrics", include_in_schema=False, dependencies=[Depends(require_admin)])
    async def metrics() -> Response:
        # async: the gauges are computed on the event loop, like the observers, never beside a half-applied event.
        async with scraping:
            stats.tick()
            window.prepare()
            # Rendering is the costly part (~150 ms for 200 tenants on a slow core): off the event loop. The
            # event metrics are prometheus_client's own, safe to read from a thread; the window gauges were
            # prepared just now, here on the loop.
            text = await anyio.to_thread.run_sync(generate_latest, registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return registry
