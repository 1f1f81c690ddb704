"""Scoped usage APIs: ``/v1/usage`` for a tenant, ``/admin/...`` for operators.

Seed 003: "Platform operators need to view aggregated hotspots, while tenants can only see their own data."

Tenant view (an API key of ``[[key]]``; 401 without a valid one)::

    GET /v1/usage?window=3600

answers the caller's own usage over the last ``window`` seconds (a whole number, 1 to ``WINDOW_MAX_S``;
default ``WINDOW_DEFAULT_S``): requests reserved, input and output tokens billed, GPU seconds billed and the
overage above the estimates (from the ledger's event log), reservations open now, and the rejections by
reason (``fairgate.gateway.observe.REJECT_REASONS``) counted in memory by this gateway process::

    {"object": "usage", "tenant": "acme", "delegate": null, "window_s": 3600,
     "requests": 3, "input_tokens": 9, "output_tokens": 21,          # reserved / billed in the window
     "gpu_seconds": 0.41, "overage_gpu_seconds": 0.0,                # billed GPU time, seconds
     "open_reservations": 0,                                         # now, whatever the window
     "spend": {"currency": "USD", "amount": 0.0012, "period": {...}}, # money: fairgate.gateway.spend
     "rejections": {"total": 2, "by_reason": {"rate": 1, "tokens": 1, ...},
                    "window_s": 3600.0},                             # min(window, REJECTIONS_RETENTION_S)
     "refunded": {"requests": 1, "input_tokens": 3, "output_tokens": 0,
                  "gpu_seconds": 0.02, "window_s": 3600.0}}          # platform failures, not billed

``requests`` counts reservations made, including those later released because the queue was full (they
bill nothing); a request refused by a quota reserves nothing and is counted only as a rejection.
Rejections are per process (several gateway processes each count their own), forgotten after
``REJECTIONS_RETENTION_S`` or a restart, and kept in ``REJECTION_BUCKET_S`` buckets (``RejectionLog``).
``refunded`` counts the calls the platform failed before the client received anything (the upstream refused
the call, died or sent no OpenAI stream): their reservations were cancelled billing nothing, and these are
the tokens and GPU time they used unbilled (``RefundLog``, per process like the rejections; the ledger holds
them as cancelled reservations billed 0).

- The tenant always comes from the credential. A ``tenant`` query parameter, or an ``X-Tenant``,
  ``X-Tenant-Id`` or ``X-Fairgate-Tenant`` header, naming anyone but the caller is refused with 403
  ``tenant_mismatch`` (the same answer whether that tenant exists or not); naming the caller itself is
  allowed. Refusing rather than ignoring tells a confused client it did not get what it asked for
  instead of silently handing it its own figures under someone else's name.
- A delegate presenting a valid on-behalf-of token (``x-fairgate-on-behalf-of``) gets the usage of the
  tenant it acts for, the tenant it would bill: the token is signed by the platform, names this delegate
  and that tenant, and expires, and it already lets the delegate spend that tenant's quota, which is more
  than reading the totals of it. The answer names the delegate (``delegate``). Without a token a delegate
  sees its own usage, as any tenant.
- Reads are rate-limited per caller (tenant and delegate; ``CallLimit``: a burst of 10, then 1 a second,
  per gateway process): past that, 429 ``rate_limit_exceeded`` with ``Retry-After``.
- An unknown query parameter, a repeated one, or a ``window`` that is not a whole number of seconds in
  range is a 400 naming the parameter.

Operator view (an ``[admin]`` key only: 401 without a key or with an unknown one, 403 with a tenant's key)::

    GET /admin/tenants                          configured tenants: tier, weight, priority pool, frozen,
                                                the limits in force (tenant-wide, and each model class's),
                                                and the prices in force (``pricing``)
    GET /admin/usage?window=3600                every configured tenant's usage, as /v1/usage
    GET /admin/reservations?tenant=&status=open&limit=100&offset=0
                                                reservations (open by default; status all: any), oldest
                                                first, pages of at most RESERVATIONS_PAGE_MAX
    GET /admin/frozen                           tenants whose automatic settlement is frozen, and why
    GET /admin/reconcile?refresh=false          a reconciliation report (``fairgate.ledger.reconcile``)

``/admin/reconcile`` is read-only (safe to poll): it runs a *dry run* (nobody is frozen; the alert is
still logged and counted) over reservations and the event log, and answers the last report when it is
younger than ``RECONCILE_REUSE_S`` (``refresh=true`` forces a new run; concurrent callers share one run).
It also lists this process's ``parked_grants`` (emergency grants the ledger would not take at replay, with
their usage and reason; ``fairgate.ledger.emergency``), which make it not ``clean``. Freezing stays an
operator decision: ``fairgate ledger reconcile``; ``fairgate ledger journal`` shows a journal and its parked
grants. It lists the refunded platform failures too (``refunded_platform_failures``: their count and GPU
seconds over ``REJECTIONS_RETENTION_S``, and the newest ``REFUNDS_LISTED_MAX``), which leave it clean: not
billing them is the rule, not a discrepancy.

Errors are OpenAI-shaped (``fairgate.gateway.outcomes``); a ledger that cannot be reached is a 503
``ledger_unavailable`` with ``Retry-After``. Figures are what the ledger has booked: emergency grants made
while the ledger was down (``fairgate.ledger.emergency``) appear once they are replayed.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from fairgate.gateway.config import GatewayConfig
from fairgate.gateway.identity import Caller, require_admin, require_tenant
from fairgate.gateway.intake import lenient_request_id
from fairgate.gateway.observe import REJECT_REASONS, Event, Fanout, Refunded, Rejected
from fairgate.gateway.outcomes import Outcome, Rejection
from fairgate.gateway.spend import pricing_document, spend_document
from fairgate.gateway.state import GatewayState, gateway_dependency
from fairgate.ledger import Limits, TenantUsage
from fairgate.ledger.base import STATUSES, Ledger, tenant_tag
from fairgate.ledger.reconcile import ReconcileReport, reconcile

WINDOW_DEFAULT_S = 86_400
WINDOW_MAX_S = 366 * 86_400  # a year and a day: longer windows are a billing export, not an API read
REJECTIONS_RETENTION_S = 86_400  # rejections are counted over min(window, this)
REJECTION_BUCKET_S = 10  # counting granularity: a window's older edge is exact to within this
RESERVATIONS_PAGE_DEFAULT = 100
RESERVATIONS_PAGE_MAX = 1_000
RESERVATIONS_OFFSET_MAX = 10**9
RECONCILE_REUSE_S = 30.0
REFUNDS_LISTED_MAX = 100  # /admin/reconcile lists the newest refunds; the totals count them all
TENANT_HEADERS = ("x-tenant", "x-tenant-id", "x-fairgate-tenant")
Gateway = Annotated[GatewayState, Depends(gateway_dependency)]
Tenant = Annotated[Caller, Depends(require_tenant)]
OTHER_REASON = "other"  # a reason outside REJECT_REASONS (kept bounded)
_WHOLE_NUMBER = re.compile(r"[0-9]{1,12}")


class RejectionLog:
    """Rejections per tenant and reason over the last ``retention_s`` seconds, from ``Rejected`` events.

    Counts are kept in buckets of ``bucket_s`` seconds, so memory is bounded whatever the rejection rate:
    at most ``retention_s / bucket_s`` buckets per tenant, each with at most one counter per reason
    (``REJECT_REASONS`` and ``other``). Only ``tenants`` (the configured ones) are tracked, plus one slot
    for rejections without a tenant (a missing or bad credential: ``tenant=None``).

    Args:
        tenants: the tenants to track; a rejection of any other tenant is dropped.
        retention_s: how long a rejection is kept, seconds.
        bucket_s: the counting granularity, seconds.
        clock: seconds since the epoch (the clock of ``Rejected.time_s``).
    """

    def __init__(
        self,
        tenants: Iterable[str],
        retention_s: float = REJECTIONS_RETENTION_S,
        bucket_s: float = REJECTION_BUCKET_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        assert retention_s > 0 and bucket_s > 0
        self.retention_s, self.bucket_s, self._clock = float(retention_s), float(bucket_s), clock
        self._buckets_max = max(1, math.ceil(retention_s / bucket_s)) + 1
        self._by_tenant: dict[str | None, deque[tuple[int, dict[str, int]]]] = {t: deque() for t in tenants}
        self._by_tenant[None] = deque()

    def track(self, tenants: Iterable[str]) -> None:
        """Track ``tenants`` too (a configuration reload adding tenants); those tracked already keep counting."""
        for tenant in tenants:
            self._by_tenant.setdefault(tenant, deque())

    def observe(self, event: Event) -> None:
        """Count a ``Rejected`` event; ignore every other event."""
        if isinstance(event, Rejected):
            self.add(event.tenant, event.reason, event.time_s)

    def add(self, tenant: str | None, reason: str, time_s: float) -> None:
        """Count one rejection of ``tenant`` for ``reason`` at ``time_s`` (seconds since the epoch)."""
        buckets = self._by_tenant.get(tenant)
        if buckets is None or not math.isfinite(time_s):
            return
        reason = reason if reason in REJECT_REASONS else OTHER_REASON
        index = math.floor(time_s / self.bucket_s)
        if not buckets or buckets[-1][0] < index:
            buckets.append((index, {}))
        # An event older than the newest bucket (the wall clock stepped back) joins the newest bucket.
        counts = buckets[-1][1]
        counts[reason] = counts.get(reason, 0) + 1
        self._prune(buckets, max(index, math.floor(self._clock() / self.bucket_s)))

    def _prune(self, buckets: deque[tuple[int, dict[str, int]]], now_index: int) -> None:
        while buckets and (buckets[0][0] <= now_index - self._buckets_max or len(buckets) > self._buckets_max):
            buckets.popleft()

    def counts(self, tenant: str | None, window_s: float) -> dict[str, int]:
        """Rejections of ``tenant`` by reason over the last ``min(window_s, retention_s)`` seconds: every
        reason of ``REJECT_REASONS`` (0 when none), and ``other`` when there were any. A bucket that
        overlaps the window counts whole, so the window's older edge is exact to within ``bucket_s``."""
        out = dict.fromkeys(REJECT_REASONS, 0)
        buckets = self._by_tenant.get(tenant)
        if buckets is None:
            return out
        now_s = self._clock()
        self._prune(buckets, math.floor(now_s / self.bucket_s))
        since_s = now_s - min(window_s, self.retention_s)
        for index, counts in buckets:
            if (index + 1) * self.bucket_s > since_s:
                for reason, n in counts.items():
                    out[reason] = out.get(reason, 0) + n
        return out


class RefundLog:
    """The calls the platform failed and refunded (``Refunded`` events) over the last ``retention_s`` seconds,
    newest last: what each used and was not billed. At most ``records_max`` are kept (the oldest go first),
    so memory is bounded whatever the failure rate; like the rejections, they are this process's only."""

    def __init__(
        self,
        retention_s: float = REJECTIONS_RETENTION_S,
        records_max: int = 10_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        assert retention_s > 0 and records_max > 0
        self.retention_s, self._clock = float(retention_s), clock
        self._records: deque[Refunded] = deque(maxlen=records_max)

    def observe(self, event: Event) -> None:
        """Keep a ``Refunded`` event; ignore every other event."""
        if isinstance(event, Refunded):
            self._records.append(event)

    def recent(self, window_s: float, tenant: str | None = None) -> list[Refunded]:
        """The refunds of the last ``min(window_s, retention_s)`` seconds (of ``tenant``, or everyone's)."""
        since_s = self._clock() - min(window_s, self.retention_s)
        while self._records and self._records[0].time_s < self._clock() - self.retention_s:
            self._records.popleft()
        return [r for r in self._records if r.time_s >= since_s and tenant in (None, r.tenant)]

    def totals(self, tenant: str, window_s: float) -> dict[str, Any]:
        """``tenant``'s refunds over the window: calls, and the tokens and GPU seconds they used unbilled."""
        records = self.recent(window_s, tenant)
        return {
            "requests": len(records),
            "input_tokens": sum(r.input_tokens for r in records),
            "output_tokens": sum(r.output_tokens for r in records),
            "gpu_seconds": sum(r.gpu_ms for r in records) / 1000.0,
            "window_s": min(float(window_s), self.retention_s),
        }


class CallLimit:
    """A token bucket per caller: ``burst`` calls at once, then ``per_s`` a second; ``take`` answers how long
    to wait (0: go). A usage read costs the ledger ~2 ms (``bench/usage_scan.py``), so one a second per
    caller keeps a polling dashboard, or a client in a loop, from becoming the ledger's load."""

    def __init__(self, burst: float = 10.0, per_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.burst, self.per_s, self._clock = burst, per_s, clock
        self._buckets: dict[str, tuple[float, float]] = {}  # caller -> (tokens, at)

    def take(self, caller: str) -> float:
        now = self._clock()
        if len(self._buckets) > 10_000:  # forget callers whose buckets are full again (bounded memory)
            full_after = self.burst / self.per_s
            self._buckets = {k: v for k, v in self._buckets.items() if now - v[1] < full_after}
        tokens, at = self._buckets.get(caller, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.per_s)
        if tokens < 1.0:
            self._buckets[caller] = (tokens, now)
            return (1.0 - tokens) / self.per_s
        self._buckets[caller] = (tokens - 1.0, now)
        return 0.0


async def _usage_of(
    state: GatewayState, rejections: RejectionLog, refunds: RefundLog, tenant: str, window_s: int
) -> dict[str, Any]:
    """A tenant's usage document: the ledger's figures over the window, this process's rejections and
    refunded platform failures, and the spend (``fairgate.gateway.spend``)."""
    booked = await state.backend.usage(tenant, float(window_s))
    document = _usage_document(booked, window_s, rejections.counts(tenant, window_s), rejections.retention_s)
    document["refunded"] = refunds.totals(tenant, window_s)
    quotas = state.config.quotas
    if tenant in quotas.tenants:
        document["spend"] = await spend_document(state.backend, quotas, tenant, booked.spend_micros, state.wall_ms())
    return document


def install(app: FastAPI, config: GatewayConfig, events: Fanout) -> RejectionLog:
    """Add the rejection counter (an observer of ``events``) and the routes of this module's docstring to the
    gateway ``app`` (built, not yet started). Returns the counter."""
    rejections = RejectionLog(config.quotas.tenants)
    events.add(rejections)
    refunds = RefundLog()
    events.add(refunds)
    reconciler = _Reconciler()
    limit = CallLimit()

    @app.get("/v1/usage")
    async def tenant_usage(request: Request, state: Gateway, caller: Tenant) -> JSONResponse:
        params = _query(request, ("window", "tenant"))
        window_s = _window(params)
        _check_own_tenant(request, params, caller)
        wait_s = limit.take(f"{caller.tenant}\n{caller.delegate or ''}")
        if wait_s > 0:
            raise Rejection(
                Outcome.RATE_LIMITED,
                f"Too many usage reads; at most {limit.per_s:g} a second after a burst of {limit.burst:g}.",
                retry_after_s=math.ceil(wait_s),
            )
        usage = await _usage_of(state, rejections, refunds, caller.tenant, window_s)
        return _answer(request, {**usage, "delegate": caller.delegate})

    @app.get("/admin/tenants", dependencies=[Depends(require_admin)])
    async def admin_tenants(request: Request, state: Gateway) -> JSONResponse:
        _query(request, ())
        return _answer(request, _tenants_document(state.config, await state.backend.frozen()))

    @app.get("/admin/usage", dependencies=[Depends(require_admin)])
    async def admin_usage(request: Request, state: Gateway) -> JSONResponse:
        window_s = _window(_query(request, ("window",)))
        tenants = sorted(state.config.quotas.tenants)
        data = [{**await _usage_of(state, rejections, refunds, name, window_s), "delegate": None} for name in tenants]
        unattributed = rejections.counts(None, window_s)
        document = {
            "object": "list",
            "window_s": window_s,
            "data": data,
            "unauthenticated_rejections": {"total": sum(unattributed.values()), "by_reason": unattributed},
        }
        return _answer(request, document)

    @app.get("/admin/reservations", dependencies=[Depends(require_admin)])
    async def admin_reservations(request: Request, state: Gateway) -> JSONResponse:
        params = _query(request, ("tenant", "status", "limit", "offset"))
        return _answer(request, await _reservations_page(state.backend, state.config, params))

    @app.get("/admin/frozen", dependencies=[Depends(require_admin)])
    async def admin_frozen(request: Request, state: Gateway) -> JSONResponse:
        _query(request, ())
        frozen = await state.backend.frozen()
        return _answer(
            request, {"object": "list", "data": [{"tenant": t, "reason": r} for t, r in sorted(frozen.items())]}
        )

    @app.get("/admin/reconcile", dependencies=[Depends(require_admin)])
    async def admin_reconcile(request: Request, state: Gateway) -> JSONResponse:
        params = _query(request, ("refresh",))
        refresh = params.get("refresh", "false")
        if refresh not in ("true", "false", "1", "0"):
            raise Rejection(Outcome.INVALID_REQUEST, "refresh must be true or false.", "refresh")
        document = await reconciler.report(state.backend, refresh in ("true", "1"))
        parked = state.ledger.parked()  # emergency grants the ledger would not take: usage not billed
        document |= {"clean": document["clean"] and not parked, "parked_grants": parked}
        document["refunded_platform_failures"] = _refunds_document(refunds)
        return _answer(request, document)

    return rejections


async def _reservations_page(ledger: Ledger, config: GatewayConfig, params: dict[str, str]) -> dict[str, Any]:
    """A page of reservations, oldest first, as ``/admin/reservations`` asks. Raises ``Rejection`` 400/404."""
    tenant = params.get("tenant")
    if tenant is not None and tenant not in config.quotas.tenants:
        raise Rejection(Outcome.TENANT_NOT_FOUND, "No tenant of that name is configured.", "tenant")
    status = params.get("status", "open")
    if status not in (*STATUSES, "all"):
        raise Rejection(Outcome.INVALID_REQUEST, f"status must be one of {', '.join(STATUSES)} or all.", "status")
    limit = _whole(params, "limit", RESERVATIONS_PAGE_DEFAULT, 1, RESERVATIONS_PAGE_MAX)
    offset = _whole(params, "offset", 0, 0, RESERVATIONS_OFFSET_MAX)
    found = await ledger.reservations(tenant, None if status == "all" else status)
    found.sort(key=lambda r: (r.created_ms, r.id))
    page = found[offset : offset + limit]
    return {
        "object": "list",
        "data": [{name: value for name, value in asdict(r).items() if name != "balances"} for r in page],
        "total": len(found),
        "limit": limit,
        "offset": offset,
        "has_more": offset + len(page) < len(found),
    }


def _tenants_document(config: GatewayConfig, frozen: dict[str, str]) -> dict[str, Any]:
    keys: dict[str, int] = {}
    for key in config.keys:
        keys[key.tenant] = keys.get(key.tenant, 0) + 1
    data = [
        {
            "tenant": name,
            "tenant_hash": tenant_tag(name),
            "tier": quota.tier.name,
            "on_ledger_unavailable": quota.tier.on_ledger_unavailable,
            "weight": quota.weight,
            "priority": quota.priority,
            "keys": keys.get(name, 0),
            "delegate": name in config.delegation.delegates,
            "frozen": name in frozen,
            "frozen_reason": frozen.get(name),
            "limits": _set(quota.limits),
            "model_class": {name: _set(limits) for name, limits in quota.by_model_class.items()},
        }
        for name, quota in sorted(config.quotas.tenants.items())
    ]
    return {"object": "list", "data": data, "pricing": pricing_document(config.quotas)}


def _check_own_tenant(request: Request, params: dict[str, str], caller: Caller) -> None:
    """Refuse a usage read that names a tenant other than the caller's (module docstring). Raises
    ``Rejection`` 400 (a tenant header sent twice) or 403 ``tenant_mismatch``."""
    for header in TENANT_HEADERS:
        if len(request.headers.getlist(header)) > 1:
            raise Rejection(Outcome.INVALID_REQUEST, f"Send {header} at most once.", header)
    named = [params.get("tenant")] + [request.headers.get(h) for h in TENANT_HEADERS]
    if any(name is not None and name != caller.tenant for name in named):
        raise Rejection(
            Outcome.TENANT_MISMATCH,
            "This key can only read its own tenant's usage; the tenant comes from the "
            "credential, not from a parameter or header.",
            "tenant",
        )


def _refunds_document(refunds: RefundLog) -> dict[str, Any]:
    """The reconciliation's ``refunded_platform_failures``. Refunds are by design (the platform's failure is not
    the tenant's to pay), so they leave the report clean; listed so that what the replicas ran unbilled adds up
    against their own counts."""
    refunded = refunds.recent(refunds.retention_s)
    return {
        "total": len(refunded),
        "gpu_seconds": sum(r.gpu_ms for r in refunded) / 1000.0,
        "window_s": refunds.retention_s,
        "recent": [asdict(r) for r in refunded[-REFUNDS_LISTED_MAX:]],
    }


def _set(limits: Limits) -> dict[str, Any]:
    """The limits in force (those not None), by field name."""
    return {field: value for field, value in asdict(limits).items() if value is not None}


class _Reconciler:
    """The last dry-run reconciliation report, reused for ``RECONCILE_REUSE_S``; one run at a time."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = asyncio.Lock()
        self._last: tuple[float, ReconcileReport] | None = None

    async def report(self, ledger: Ledger, refresh: bool) -> dict[str, Any]:
        asked_s = self._clock()
        async with self._lock:
            last = self._last
            fresh = last is not None and (last[0] >= asked_s or (not refresh and asked_s - last[0] < RECONCILE_REUSE_S))
            if not fresh:
                report = await reconcile(ledger, None, freeze=False)
                self._last = last = (self._clock(), report)
        assert last is not None
        generated_s, report = last
        return {
            "object": "reconciliation",
            "dry_run": True,
            "generated_at_s": generated_s,
            "age_s": max(0.0, self._clock() - generated_s),
            **report.to_json(),
        }


def _usage_document(booked: TenantUsage, window_s: int, rejected: dict[str, int], retention_s: float) -> dict[str, Any]:
    return {
        "object": "usage",
        "tenant": booked.tenant,
        "window_s": window_s,
        "requests": booked.requests,
        "input_tokens": booked.input_tokens,
        "output_tokens": booked.output_tokens,
        "gpu_seconds": booked.gpu_ms / 1000.0,
        "overage_gpu_seconds": booked.overage_gpu_ms / 1000.0,
        "open_reservations": booked.open_reservations,
        "rejections": {
            "total": sum(rejected.values()),
            "by_reason": rejected,
            "window_s": min(float(window_s), retention_s),
        },
    }


def _answer(request: Request, document: dict[str, Any]) -> JSONResponse:
    """A 200 with ``document``, ``x-request-id`` and no caching."""
    return JSONResponse(document, headers={"x-request-id": lenient_request_id(request), "cache-control": "no-store"})


def _query(request: Request, allowed: tuple[str, ...]) -> dict[str, str]:
    """The query parameters, each at most once and each in ``allowed``. Raises ``Rejection`` 400."""
    out: dict[str, str] = {}
    for name, value in request.query_params.multi_items():
        if name not in allowed:
            raise Rejection(
                Outcome.INVALID_REQUEST,
                f"Unknown query parameter {name[:100]!r}"
                f"{'; this endpoint takes ' + ', '.join(allowed) if allowed else ''}.",
                name[:100],
            )
        if name in out:
            raise Rejection(Outcome.INVALID_REQUEST, f"Send {name} at most once.", name)
        out[name] = value
    return out


def _whole(params: dict[str, str], name: str, default: int, low: int, high: int) -> int:
    """The whole number ``params[name]`` in ``[low, high]`` (``default`` when absent). Raises ``Rejection`` 400."""
    text = params.get(name)
    if text is None:
        return default
    if not _WHOLE_NUMBER.fullmatch(text) or not low <= int(text) <= high:
        raise Rejection(
            Outcome.INVALID_REQUEST, f"{name} must be a whole number from {low} to {high}, got {text[:40]!r}.", name
        )
    return int(text)


def _window(params: dict[str, str]) -> int:
    """``window``: whole seconds in ``[1, WINDOW_MAX_S]`` (default ``WINDOW_DEFAULT_S``). Raises ``Rejection``."""
    text = params.get("window")
    if text is None:
        return WINDOW_DEFAULT_S
    if not _WHOLE_NUMBER.fullmatch(text) or not 1 <= int(text) <= WINDOW_MAX_S:
        raise Rejection(
            Outcome.INVALID_WINDOW,
            f"window must be a whole number of seconds from 1 to {WINDOW_MAX_S}, got {text[:40]!r}.",
            "window",
        )
    return int(text)


__all__ = ["RejectionLog", "install"]
