"""Health: ``/health/live`` (and its alias ``/health``: the process serves HTTP) and ``/health/ready`` (requests
can be admitted), for a load balancer or an orchestrator's probes."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from fairgate.gateway.state import GatewayState
from fairgate.ledger import LedgerUnavailable

READY_LEDGER_TIMEOUT_S = 1.0


def install(app: FastAPI, state: GatewayState) -> None:
    """Add the health routes to ``app`` (200 when live / ready; 503 with the reasons when not ready)."""

    @app.get("/health")
    @app.get("/health/live")
    async def live() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/health/ready")
    async def ready(request: Request) -> JSONResponse:
        document = await readiness(state)
        code = 200 if document["status"] == "ready" else 503
        if not state.identity.is_admin(request):
            document = anonymous(document)
        return JSONResponse(document, status_code=code)


async def readiness(state: GatewayState) -> dict[str, Any]:
    """``/health/ready``: ready when requests can be admitted - the ledger answers (a cheap read, bounded by
    ``READY_LEDGER_TIMEOUT_S``) or some tier has an emergency policy to serve an outage with - and every model
    name clients may send (an alias or a plain model) has an upstream up in one of its pools (an alias whose
    primary pool is down is ready on a fallback). ``upstreams_up``: model name -> upstreams up in its pools.
    ``/health`` and ``/health/live`` say only that the process serves HTTP. The route answers this document
    to an admin key, ``anonymous(document)`` to anyone else."""
    try:
        await asyncio.wait_for(state.backend.frozen(), timeout=READY_LEDGER_TIMEOUT_S)
        ledger = "ok"
    except (LedgerUnavailable, TimeoutError, RuntimeError):
        ledger = "unavailable"
    emergency = any(t.tier.on_ledger_unavailable == "emergency" for t in state.config.quotas.tenants.values())
    pools: dict[str, int] = {}
    for upstream in state.dispatcher.upstreams():
        pools[upstream.pool] = pools.get(upstream.pool, 0) + (1 if upstream.serving else 0)
    up = {name: sum(pools.get(p, 0) for p in served.pools) for name, served in state.config.served.items()}
    reasons = [f"no upstream of model {model!r} is up" for model, n in sorted(up.items()) if n == 0]
    if ledger != "ok" and not emergency:
        reasons.append("the ledger does not answer and no tier has an emergency policy")
    status = "not_ready" if reasons else "ready"
    return {"status": status, "ledger": ledger, "upstreams_up": up, "reasons": reasons}


def anonymous(document: dict[str, Any]) -> dict[str, Any]:
    """``readiness`` without the model names, for a caller without an admin key: the probe is unauthenticated
    and a model name can be a tenant's own (an adapter: ``[access]``), so it gets counts only - the models with
    an upstream up, of how many - and the reasons with each model's name left out."""
    up = document["upstreams_up"]
    models_down = sum(1 for n in up.values() if n == 0)
    reasons = [r for r in document["reasons"] if not r.startswith("no upstream of model")]
    if models_down:
        reasons.insert(0, f"{models_down} of {len(up)} models have no upstream up (an admin key shows which)")
    ready = len(up) - models_down
    return {
        "status": document["status"],
        "ledger": document["ledger"],
        "models_ready": ready,
        "models": len(up),
        "reasons": reasons,
    }
