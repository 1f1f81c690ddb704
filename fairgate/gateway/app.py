"""The gateway's ASGI app: OpenAI-compatible, tenants from their credential, quota admission, GPU-time
fair dispatch. This module only wires the parts together.

A request goes through the stages of ``fairgate.gateway.completions`` (intake -> admission -> queueing ->
call); every refusal is a ``Rejection`` answered from the one table of ``fairgate.gateway.outcomes``. The
shared state (``fairgate.gateway.state``) is built here and handed to requests through the lifespan, which
opens the ledger and the upstream clients and starts the background work (``fairgate.gateway.background``).
The operator views (metrics, usage, request log, dashboard) observe the request path's events.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fairgate.core.policies.factory import TenantShare, make_policy
from fairgate.gateway import (
    accesslog,
    admin_api,
    completions,
    dashboard,
    dashboard_history,
    eventlog,
    health,
    lifespan,
    metrics,
    reload,
    signin,
    usage_api,
)
from fairgate.gateway.config import GatewayConfig
from fairgate.gateway.dispatch import Dispatcher, Upstream
from fairgate.gateway.identity import Identity, require_admin
from fairgate.gateway.intake import lenient_request_id
from fairgate.gateway.observe import Charged, Fanout, Observer
from fairgate.gateway.outcomes import Outcome, Rejection, respond
from fairgate.gateway.state import Clock, GatewayState, SystemClock
from fairgate.gateway.stats import Stats, gateway_probe
from fairgate.ledger import Ledger, LedgerUnavailable

log = logging.getLogger("fairgate.gateway")
_STARLETTE_OUTCOMES = {404: Outcome.ROUTE_NOT_FOUND, 405: Outcome.METHOD_NOT_ALLOWED}


def create_gateway(
    config: GatewayConfig,
    ledger: Ledger | None = None,
    observers: Iterable[Observer] = (),
    *,
    clock: Clock | None = None,
    rng: random.Random | None = None,
) -> FastAPI:
    """The gateway's ASGI app for ``config``.

    Args:
        ledger: an open ledger to use (the caller closes it); default: open ``[gateway].ledger`` when the
            app starts (on its own event loop) and close it when it stops.
        observers: receive every request's events (``fairgate.gateway.observe``).
        clock: the gateway's clocks (default: the system's).
        rng: the random source of ``Retry-After`` jitter (default: seeded from the system).

    Raises:
        GatewayConfigError: an upstream's API key cannot be read (``GatewayConfig.upstream_keys``).
    """
    keys = config.upstream_keys()  # a key that cannot be read stops the gateway before it serves
    state = build_state(config, observers, clock or SystemClock(), rng or random.Random())
    # No Swagger UI or ReDoc: their pages load scripts from a CDN, which the gateway's hosts cannot reach and
    # its callers should not be sent to; the schema is served to admin keys only (``_install_schema``).
    app = FastAPI(
        title="fairgate gateway",
        lifespan=lifespan.lifespan(state, ledger, keys),
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        # A path with a trailing slash is not found, not redirected: Starlette's redirect builds its Location
        # from the client's Host header (an outside tester's Host: evil.example came back in it).
        redirect_slashes=False,
    )
    app.state.gateway = state  # for ``state_of(app)`` only: requests get it from the lifespan
    _install_error_handlers(app, state)
    completions.install(app)
    _install_views(app, state)
    _install_schema(app)

    health.install(app, state)
    reload.install(app, state)
    admin_api.install(app)
    signin.install(app)

    return app


def build_state(config: GatewayConfig, observers: Iterable[Observer], clock: Clock, rng: random.Random) -> GatewayState:
    """The state of a gateway for ``config``, not yet started: identity, dispatcher and events."""
    events = Fanout(observers)
    shares = {name: TenantShare(t.weight, t.priority) for name, t in config.quotas.tenants.items()}
    upstreams = [Upstream(u.name, u.model, u.url, u.max_batch, u.cost, pool=u.pool_name) for u in config.upstreams]
    spec = config.policy_spec()

    def max_queued(tenant: str) -> int | None:
        try:  # the state's configuration, not the start's: a reload may change it
            return state.config.quotas.tenant(tenant).limits.max_queued
        except KeyError:
            return 0

    def charged(model: str, tenant: str, gpu_ms: float) -> None:
        events.observe(Charged(tenant, model, gpu_ms, clock.wall_s()))

    dispatcher = Dispatcher(
        lambda: make_policy(spec, upstreams[0].cost, shares),
        upstreams,
        lambda: clock.monotonic_s() * 1000.0,
        max_queued,
        on_charge=charged,
    )
    state = GatewayState(config, clock, rng, events, Identity(config, clock.wall_s), dispatcher)
    return state


def _install_views(app: FastAPI, state: GatewayState) -> None:
    """The operator's and tenants' views, each observing the request path's events: metrics, usage, the
    request log, the dashboard (the last two share one ``Stats``)."""
    config = state.config
    weights = {name: t.weight for name, t in config.quotas.tenants.items()}
    stats = Stats(gateway_probe(state.dispatcher, state.upstreams), weights, clock=state.clock.wall_s)
    state.events.add(stats)
    state.metrics_registry = metrics.install(app, config, stats, state.events)
    rejections = usage_api.install(app, config, state.events)
    event_log = eventlog.install(app, config, state.events)
    accesslog.install(app, state)
    dashboard.install(app, stats, config.gateway.slo_ttft_p99_s * 1000.0)
    history = dashboard_history.install(app, config.dashboard_history_path, config.quotas.tenants, stats)

    def reloaded(new: GatewayConfig) -> None:
        stats.weights = {name: t.weight for name, t in new.quotas.tenants.items()}
        rejections.track(new.quotas.tenants)
        event_log.reconfigure(new.quotas.tenants)
        if history is not None:
            history.rename(new.quotas.tenants)

    state.on_reload.append(reloaded)


def _install_schema(app: FastAPI) -> None:
    """``GET /openapi.json``: the OpenAPI schema, for admin keys only (it lists the admin routes)."""

    @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(require_admin)])
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())


def _install_error_handlers(app: FastAPI, state: GatewayState) -> None:
    """Answer every error OpenAI-shaped: a ``Rejection`` from its outcome, the ledger down as 503, an
    unknown route or method as 404/405, anything else as 500 (logged)."""

    def answer(request: Request, rejection: Rejection) -> JSONResponse:
        return respond(rejection, lenient_request_id(request), state.rng)

    @app.exception_handler(Rejection)
    async def rejected(request: Request, exc: Rejection) -> JSONResponse:
        return answer(request, exc)

    @app.exception_handler(LedgerUnavailable)
    async def ledger_down(request: Request, exc: LedgerUnavailable) -> JSONResponse:
        return answer(request, Rejection(Outcome.LEDGER_UNAVAILABLE, "Accounting is unavailable; retry later."))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        outcome = _STARLETTE_OUTCOMES.get(exc.status_code, Outcome.HTTP_ERROR)
        status = exc.status_code if outcome is Outcome.HTTP_ERROR else None
        return answer(request, Rejection(outcome, str(exc.detail), status=status))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        request_id = lenient_request_id(request)
        log.exception("unexpected error serving %s", request_id)
        message = "Internal error; the request was not billed beyond what ran."
        return respond(Rejection(Outcome.INTERNAL_ERROR, message), request_id, state.rng)
