"""The live dashboard at ``GET /dashboard``.

- ``GET /dashboard``: the page (no data in it): a key form, or a sign-in link's token
  (``/dashboard#signin=...``, ``fairgate.gateway.signin``); either is kept in the tab's ``sessionStorage``
  and sent as ``Authorization: Bearer`` to the JSON endpoint every 2.5 s. A tenant idle for a sample, or
  samples missing, is a gap in its lines, not a line drawn across. Charts use Chart.js, served from
  this package (``static/chart.umd.min.js``, MIT, ``static/chart.js.LICENSE.md``), never a CDN; the page's
  Content-Security-Policy allows scripts, styles and requests to this origin only.
- ``GET /dashboard/static/<file>``: the page's script, style sheet and Chart.js (a fixed list of files).
- ``GET /dashboard/data``: the figures (``Stats.samples`` and totals, ``fairgate.gateway.stats``) as JSON.
  The scope comes from the key alone; query parameters are ignored:

  * an ``[admin]`` key: every tenant, by name (operators see names; ``/metrics`` has hashes only), each
    tenant's share of the GPU time charged in the pool, and the pools' fairness (max/min, Jain's index),
    queue and TTFT p99 and the upstreams' busy fraction;
  * a tenant's key: that tenant's own series only, labelled ``"you"``; its GPU time as a share of the pool's
    *capacity* (the upstreams' time), not of what others used; and of the pool only the SLO figure, p99 TTFT
    against its target. Nothing in it names, counts or measures another tenant. A delegate's on-behalf-of
    token is refused (403): the dashboard shows the key holder's own data.

Series (one point per sample, ``stats.SAMPLE_EVERY_S`` apart; ``t`` is seconds relative to ``now_s``):
``gpu_share`` / ``capacity_share`` (0-1, over the window), ``queue_p99_ms``, ``ttft_incl_queue_p99_ms``
(window; TTFT from admission, the queue included, as everywhere in fairgate),
``admissions_per_s``, ``rejections_per_s``, ``input_tokens_per_s``, ``output_tokens_per_s`` (since the
previous sample), ``running``, ``queued`` (now), ``gpu_s`` (cumulative GPU seconds charged),
``reserve_gap_gpu_s``, ``reserve_gap_output_tokens`` (reserved minus billed over the window). Each tenant's
totals carry ``demand_limited``: its queue p99 over the window is under ``BACKLOG_QUEUE_MS`` (it got every slot
it asked for, so its share says how much it asked; None: no request of its was dispatched in the window), and
``spend``: what its finished requests cost since the start, in ``currency`` (``[quotas.pricing]``; 0 unpriced).
``priced`` says whether any model class has a price: the page shows no spend column when none has.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from fairgate.core.fairness import BACKLOG_QUEUE_MS
from fairgate.gateway.config import GatewayConfig
from fairgate.gateway.outcomes import Outcome, Rejection
from fairgate.gateway.signin import DashboardCaller
from fairgate.gateway.state import gateway_of
from fairgate.gateway.stats import Stats, TenantTotals

STATIC = Path(__file__).parent / "static"
REFRESH_S = 2.5
_FILES = {
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
    "chart.umd.min.js": "text/javascript",
    "chart.js.LICENSE.md": "text/plain",
}
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_TENANT_FIELDS = (
    "capacity_share",
    "queue_p99_ms",
    "ttft_incl_queue_p99_ms",
    "admissions_per_s",
    "rejections_per_s",
    "running",
    "queued",
    "input_tokens_per_s",
    "output_tokens_per_s",
    "gpu_s",
    "reserve_gap_gpu_s",
    "reserve_gap_output_tokens",
)
_ADMIN_FIELDS = ("gpu_share", *_TENANT_FIELDS)
_ATTRIBUTE = {"ttft_incl_queue_p99_ms": "ttft_p99_ms"}  # the JSON's name -> ``stats.TenantPoint``'s, where they differ
YOU = "you"


def _round(value: float | int | None) -> float | int | None:
    if isinstance(value, float):
        return round(value, 6)
    return value


def _totals(totals: TenantTotals) -> dict[str, Any]:
    return {
        "admissions": totals.admissions,
        "rejections": dict(sorted(totals.rejections.items())),
        "finished": dict(sorted(totals.finished.items())),
        "input_tokens": totals.billed.input_tokens,
        "output_tokens": totals.billed.output_tokens,
        "gpu_s": round(totals.gpu_ms / 1000.0, 6),
        "reserved_gpu_s": round(totals.reserved_gpu_ms / 1000.0, 6),
        "settled_gpu_s": round(totals.billed.gpu_ms / 1000.0, 6),
        "reserved_output_tokens": totals.reserved_output_tokens,
        "spend": round(totals.spend_micros / 1e6, 6),
    }


def payload(
    stats: Stats, tenant: str | None, ttft_target_ms: float, pools: Collection[str] | None = None
) -> dict[str, Any]:
    """The dashboard's JSON: every tenant by name when ``tenant`` is None (an admin), else only ``tenant``'s
    own series as ``"you"`` and the SLO figures of the pools it may reach (``pools``; None: all; see module
    docstring)."""
    stats.tick()
    samples = list(stats.samples)
    now = stats.clock()
    fields = _ADMIN_FIELDS if tenant is None else _TENANT_FIELDS
    if tenant is None:
        names = sorted({name for s in samples for name in s.tenants} | set(stats.totals))
        labels = {name: name for name in names}
    else:
        labels = {tenant: YOU}
    series = {}
    for name, label in labels.items():
        points = [s.tenants.get(name) for s in samples]
        series[label] = {
            f: [_round(getattr(p, _ATTRIBUTE.get(f, f))) if p is not None else None for p in points] for f in fields
        }
    models = sorted({m for s in samples for m in s.pools if pools is None or m in pools})
    pool: dict[str, Any] = {
        "ttft_target_ms": ttft_target_ms,
        "ttft_incl_queue_p99_ms": {
            m: [_round(s.pools[m].ttft_p99_ms) if m in s.pools else None for s in samples] for m in models
        },
    }
    totals = {label: _totals(stats.totals.get(name) or TenantTotals()) for name, label in labels.items()}
    window = stats.window().tenants
    for name, label in labels.items():
        wait_ms = window[name].queue_p99_ms if name in window else None
        totals[label]["demand_limited"] = None if wait_ms is None else wait_ms < BACKLOG_QUEUE_MS
    if tenant is None:
        for name in ("max_min", "jain", "queue_p99_ms"):
            pool[name] = {
                m: [_round(getattr(s.pools[m], name)) if m in s.pools else None for s in samples] for m in models
            }
        upstreams = sorted({u for s in samples for u in s.busy})
        pool["busy"] = {u: [_round(s.busy.get(u)) for s in samples] for u in upstreams}
        pool["unattributed_rejections"] = dict(sorted(stats.unattributed_rejections.items()))
    return {
        "scope": "admin" if tenant is None else "tenant",
        "now_s": now,
        "window_s": stats.window_s,
        "sample_every_s": stats.sample_every_s,
        "refresh_s": REFRESH_S,
        "t": [round(s.t_s - now, 3) for s in samples],
        "series": series,
        "totals": totals,
        "pool": pool,
    }


def reachable_pools(config: GatewayConfig, tenant: str) -> set[str]:
    """The pools serving a model name ``tenant`` may send (``[access]``): the only pools whose figures it
    sees, so that another tenant's private model (a LoRA adapter's pool) is not named to it."""
    return {
        pool for name, served in config.served.items() if config.access.allows(tenant, name) for pool in served.pools
    }


def install(app: FastAPI, stats: Stats, ttft_target_ms: float) -> None:
    """Add ``/dashboard``, ``/dashboard/static/<file>`` and ``/dashboard/data`` to the gateway ``app``: the
    charts of ``stats``, the pool's TTFT p99 drawn against ``ttft_target_ms``."""
    cache: dict[str, bytes] = {}

    def read(name: str) -> bytes:
        if name not in cache:
            cache[name] = (STATIC / name).read_bytes()
        return cache[name]

    @app.get("/dashboard", include_in_schema=False)
    async def page() -> Response:
        return Response(
            read("dashboard.html"),
            media_type="text/html; charset=utf-8",
            headers={
                "content-security-policy": _CSP,
                "x-content-type-options": "nosniff",
                "referrer-policy": "no-referrer",
                "cache-control": "no-cache",
            },
        )

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in _FILES:
            raise Rejection(Outcome.ROUTE_NOT_FOUND, "Not Found")
        return Response(
            read(name),
            media_type=_FILES[name],
            headers={"x-content-type-options": "nosniff", "cache-control": "public, max-age=300"},
        )

    @app.get("/dashboard/data", include_in_schema=False)
    async def data(request: Request, caller: DashboardCaller) -> Response:
        # async: runs on the event loop with the observers, so it reads a consistent state.
        if caller is not None and caller.delegate is not None:
            raise Rejection(
                Outcome.DELEGATION_NOT_ALLOWED,
                "The dashboard shows the key holder's own data; on-behalf-of tokens are not accepted here.",
            )
        tenant = None if caller is None else caller.tenant
        config = gateway_of(request).config
        pools = None if tenant is None else reachable_pools(config, tenant)
        quotas = config.quotas
        document = {**payload(stats, tenant, ttft_target_ms, pools), "currency": quotas.currency}
        document["priced"] = bool(quotas.prices)
        return JSONResponse(document, headers={"cache-control": "no-store"})
