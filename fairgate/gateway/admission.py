"""Admission, the second stage: a ledger reservation for the request, or a typed refusal.

The reservation holds the estimated prompt, ``max_tokens`` and the GPU-time estimate against every
dimension of the tenant's quota vector at once (``fairgate.ledger``): 429 with ``Retry-After`` and the
dimension at fault when one is full, 503 when the ledger is down for a ``reject`` tier (an ``emergency``
tier gets a grant from its local budget instead, ``fairgate.ledger.emergency``). A request id seen before
returns its original reservation: a final one is not run or charged again (409), and one this process is
serving already is not run twice (409). The admitted request is registered with this process's calls (the
liveness sweep heartbeats its reservation) and announced as ``Admitted``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass

from fairgate.gateway.headers import quota_headers
from fairgate.gateway.identity import Caller
from fairgate.gateway.intake import Generation
from fairgate.gateway.observe import Admitted as AdmittedEvent
from fairgate.gateway.outcomes import Outcome, Rejection
from fairgate.gateway.state import GatewayState
from fairgate.ledger import (
    IdempotencyConflict,
    LedgerError,
    LedgerUnavailable,
    QuotaExceeded,
    Reservation,
    UnknownTenant,
    Usage,
)
from fairgate.ledger.emergency import EMERGENCY_PREFIX, ResilientLedger
from fairgate.ledger.rules import Account

log = logging.getLogger("fairgate.gateway")
# A reservation older than this when its request is admitted again (a client's retry of a request whose
# gateway process died) is heartbeat at once, before another process's liveness sweep could expire it.
READMIT_AFTER_MS = 1000.0


@dataclass(frozen=True)
class Admitted:
    """A request that holds a reservation and is registered with this process's calls.

    Attributes:
        generation: the request (``fairgate.gateway.intake``).
        caller: its tenant and delegate.
        reservation: what the ledger holds for it.
        balances: the tenant's balances after the reservation, read beside the dispatch for the
            ``x-ratelimit-*`` headers (None for an emergency grant).
    """

    generation: Generation
    caller: Caller
    reservation: Reservation
    balances: asyncio.Future[Account] | None


async def admit(state: GatewayState, caller: Caller, generation: Generation) -> Admitted:
    """Reserve and register ``generation`` (see module docstring). Raises ``Rejection`` 403/409/429/503."""
    reservation = await _reserve(state, caller.tenant, generation)
    if reservation.is_final:
        raise Rejection(
            Outcome.REQUEST_ALREADY_COMPLETED,
            f"Request {generation.request_id!r} has completed already ({reservation.status}); it is not "
            "run or charged again.",
            "x-request-id",
        )
    await mark_readmitted(state.ledger, reservation, state.wall_ms())
    if not state.calls.claim(caller.tenant, generation.request_id, reservation.id):
        raise Rejection(
            Outcome.REQUEST_IN_PROGRESS,
            f"Request {generation.request_id!r} is being served already; it is not run twice.",
            "x-request-id",
        )
    state.events.observe(
        AdmittedEvent(
            generation.request_id,
            caller.tenant,
            caller.delegate,
            generation.model,
            reservation.id,
            generation.prompt_tokens,
            generation.max_tokens,
            generation.gpu_ms_estimate,
            state.clock.wall_s(),
        )
    )
    balances = None
    if not reservation.id.startswith(EMERGENCY_PREFIX):
        balances = asyncio.ensure_future(state.ledger.account(caller.tenant, generation.model))
    return Admitted(generation, caller, reservation, balances)


async def _reserve(state: GatewayState, tenant: str, generation: Generation) -> Reservation:
    """The ledger's reservation, its refusals as ``Rejection``s."""
    try:
        return await state.ledger.reserve(
            tenant,
            generation.request_id,
            generation.prompt_tokens,
            generation.max_tokens,
            generation.gpu_ms_estimate,
            generation.model,
            generation.run.run_id,
            generation.run.tool_round,
        )
    except QuotaExceeded as exc:
        outcome = Outcome.QUOTA_EXHAUSTED if exc.retry_after_s is None else Outcome.RATE_LIMITED
        raise Rejection(
            outcome,
            f"Quota {exc.dimension} exceeded for this tenant.",
            retry_after_s=exc.retry_after_s,
            dimension=exc.dimension,
            headers=quota_headers(exc),
        ) from None
    except IdempotencyConflict:
        raise Rejection(
            Outcome.IDEMPOTENCY_CONFLICT, "This request id was used before with a different request.", "x-request-id"
        ) from None
    except LedgerUnavailable:
        raise Rejection(Outcome.LEDGER_UNAVAILABLE, "Accounting is unavailable; retry later.") from None
    except UnknownTenant:
        raise Rejection(Outcome.TENANT_NOT_CONFIGURED, "This tenant has no quota configuration.") from None


async def mark_readmitted(front: ResilientLedger, reservation: Reservation, now_ms: float) -> None:
    """Mark an open reservation made more than ``READMIT_AFTER_MS`` before ``now_ms`` running at once."""
    if reservation.is_final or reservation.id.startswith(EMERGENCY_PREFIX):
        return
    if now_ms - reservation.created_ms <= READMIT_AFTER_MS:
        return
    with contextlib.suppress(LedgerError):
        await front.heartbeat(reservation.id)


async def release(state: GatewayState, admitted: Admitted) -> None:
    """Give back a reservation whose request never ran (nothing is billed) and forget the request."""
    try:
        await state.ledger.cancel(admitted.reservation.id, Usage())
    except LedgerError as exc:
        log.warning(json.dumps({"event": "release_failed", "reservation": admitted.reservation.id, "error": str(exc)}))
    finally:
        state.calls.release(admitted.caller.tenant, admitted.generation.request_id)
