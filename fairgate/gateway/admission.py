"""Admission, the second stage: a ledger reservation for the request, or a typed refusal.

The reservation holds the estimated prompt, ``max_tokens`` and the GPU-time estimate against every
dimension of the tenant's quota vector at once (``fairgate.ledger``): 429 with ``Retry-After`` and the
dimension at fault when one is full, 503 when the ledger is down for a ``reject`` tier (an ``emergency``
tier gets a grant from its local budget instead, ``fairgate.ledger.emergency``). A request id seen before
returns its original reservation: a final one is not run or charged again (409), nor is an open one whose
request ran in this process but whose final settlement the ledger did not take (``GatewayState.unsettled``),
and one another request is being served under already is not run twice (409 ``request_in_progress``): in this
process by its call registry (released only once the call's final settlement has ended), across the
processes sharing the ledger by the reservation's run claim, which this process takes in the reserve's own call
(``reserve(..., claim_owner=...)``: one ledger call, not two) before it runs the request, and its liveness sweep
renews (``Ledger.claim``). The admitted request is registered with this process's calls and announced as
``Admitted``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass

import anyio

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
    ReservationFinal,
    ReservationNotFound,
    UnknownTenant,
    Usage,
)

log = logging.getLogger("fairgate.gateway")

# The one refusal whose end the ledger knows for sure: the requests bucket refills at a fixed rate, and what
# it holds does not depend on the request's size (``rules``).
REQUEST_RATE = "requests_per_minute"


@dataclass(frozen=True)
class Admitted:
    """A request that holds a reservation and is registered with this process's calls.

    Attributes:
        generation: the request (``fairgate.gateway.intake``).
        caller: its tenant and delegate.
        reservation: what the ledger holds for it, with the tenant's balances right after the reservation
            (``Reservation.balances``, behind the ``x-ratelimit-*`` headers; None for an emergency grant).
    """

    generation: Generation
    caller: Caller
    reservation: Reservation


async def admit(state: GatewayState, caller: Caller, generation: Generation) -> Admitted:
    """Reserve and register ``generation`` (see module docstring). Raises ``Rejection`` 403/409/429/503."""
    sent_s = state.clock.monotonic_s()
    reservation = await _reserve_and_claim(state, caller.tenant, generation)
    if reservation.is_final:
        state.unsettled.discard(reservation.id)
        state.unsettled_requests.discard((caller.tenant, generation.request_id))
        raise _final(generation.request_id, reservation.status)
    if reservation.id in state.unsettled:  # it ran here; its final settlement has not reached the ledger
        raise _completed(generation.request_id, "has run already (it is billed once the ledger takes its usage).")
    if not state.calls.claim(caller.tenant, generation.request_id, reservation.id):
        raise _in_progress(generation.request_id, None)
    try:
        _check_run_claim(state, generation.request_id, reservation)
        if reservation.claim is None:  # the reserve could not ask the ledger for it
            await _claim_run(state, generation.request_id, reservation)
        if reservation.billed != Usage():
            await _close_abandoned(state, generation.request_id, reservation)
        if reservation.claim is not None and reservation.balances is not None:  # the ledger's claim, not a grant's
            state.calls.run_claim_held(reservation.id, sent_s + state.claim_lease_ms / 1000.0)
    except Rejection:
        state.calls.release(caller.tenant, generation.request_id)
        raise
    except BaseException:  # cancelled (the client left) between the reserve and the hand-off
        state.calls.release(caller.tenant, generation.request_id)
        with anyio.CancelScope(shield=True):
            await _release_unclaimed(state, reservation)
        raise
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
            caller.key_id,
        )
    )
    return Admitted(generation, caller, reservation)


async def _reserve_and_claim(state: GatewayState, tenant: str, generation: Generation) -> Reservation:
    """The ledger's reservation with the run claim for this process, in one call, its refusals as ``Rejection``s.
    The claim is not asked for a request id this process serves now or ran without its final settlement reaching
    the ledger: ``admit`` refuses those, and leaves their claim as it is. A caller cancelled (its client gone)
    while the call runs waits for its answer, shielded: a reservation it claimed is cancelled billing nothing
    (``_release_cancelled``), so a retry is served at once, here or on another process."""
    key = (tenant, generation.request_id)
    owner = None if state.calls.serves(*key) or key in state.unsettled_requests else state.process_id
    reserving = asyncio.ensure_future(_reserve(state, tenant, generation, owner))
    try:
        return await asyncio.shield(reserving)
    except asyncio.CancelledError:
        with anyio.CancelScope(shield=True):
            await _release_cancelled(state, tenant, generation.request_id, reserving)
        raise


async def _release_cancelled(
    state: GatewayState, tenant: str, request_id: str, reserving: asyncio.Future[Reservation]
) -> None:
    """The reserve of a request whose caller was cancelled meanwhile: once it answers, a reservation it claimed
    for this process, open with nothing billed, is cancelled - unless another call of this process serves the
    request id (then the claim is that call's). Best effort, as ``_release_unclaimed``."""
    try:
        reservation = await reserving
    except (Exception, asyncio.CancelledError):  # refused or failed: nothing of this request to give back
        return
    claim = reservation.claim
    if (
        claim is None
        or not claim.held_by(state.process_id)
        or reservation.is_final
        or reservation.id in state.unsettled
    ):
        return
    if not state.calls.claim(tenant, request_id, reservation.id):
        return
    try:
        if reservation.billed == Usage():
            with contextlib.suppress(LedgerError):
                await state.ledger.cancel(reservation.id, Usage())
    finally:
        state.calls.release(tenant, request_id)


async def _reserve(state: GatewayState, tenant: str, generation: Generation, claim_owner: str | None) -> Reservation:
    """The ledger's reservation (with the run claim for ``claim_owner``, when given), its refusals as
    ``Rejection``s."""
    try:
        return await state.ledger.reserve(
            tenant,
            generation.request_id,
            generation.prompt_tokens,
            generation.max_tokens,
            generation.gpu_ms_estimate,
            generation.model_class,  # an alias's quota class: every pool it falls back to draws on it
            generation.run.run_id,
            generation.run.tool_round,
            claim_owner,
            state.claim_lease_ms,
        )
    except QuotaExceeded as exc:
        if exc.dimension == REQUEST_RATE and exc.retry_after_s is not None:
            state.request_rate_refused[tenant] = state.clock.monotonic_s() + exc.retry_after_s
        outcome = Outcome.QUOTA_EXHAUSTED if exc.retry_after_s is None else Outcome.RATE_LIMITED
        raise Rejection(
            outcome,
            _quota_message(exc, state.config.quotas.currency),
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


def _quota_message(exc: QuotaExceeded, currency: str) -> str:
    """The client's message for a quota refusal; a spend budget's says what a request is held at (its worst
    case) and what to change."""
    message = f"Quota {exc.dimension} exceeded for this tenant."
    if exc.dimension != "spend_budget":
        return message
    if exc.retry_after_s is None:
        return (
            f"{message[:-1]}: the request's worst case (its prompt and all of max_tokens at the model's price) "
            f"costs more than the whole budget of a period ({exc.limit:g} {currency}); lower max_tokens."
        )
    left = exc.remaining if isinstance(exc.remaining, float | int) else 0.0
    return (
        f"{message[:-1]}: {left:.6g} {currency} is left this period, less than the request's worst case (its "
        "prompt and all of max_tokens at the model's price); lower max_tokens, or retry in the next period."
    )


def _check_run_claim(state: GatewayState, request_id: str, reservation: Reservation) -> None:
    """The run claim the reserve took (``Reservation.claim``; None: not asked). Raises ``Rejection`` 409 when
    another process holds it (``Retry-After``: until its lease lapses)."""
    claim = reservation.claim
    if claim is not None and not claim.held_by(state.process_id):
        raise _in_progress(request_id, claim.remaining_ms / 1000.0)


async def hold_run_claim(state: GatewayState, admitted: Admitted) -> None:
    """Before the request is sent upstream: its run claim must hold for at least a third of the lease by this
    process's clock (the sweep renews it every third), or it is renewed now. A process paused or cut off from the
    ledger while the request was queued may have lost it: a retry on another process ran it meanwhile (an
    outside tester's SIGSTOP for 4.5 s: run twice, billed once). A ledger that cannot say leaves the request to
    run, as one dispatched during an outage runs (nobody else can take its claim then). Raises ``Rejection`` 409
    when another process holds the claim or the reservation closed; the request is then forgotten here."""
    reservation, now_s = admitted.reservation, state.clock.monotonic_s()
    if state.calls.run_claim_left_s(reservation.id, now_s) >= state.claim_lease_ms / 3000.0:
        return
    try:
        held = await renew_run_claim(state, reservation.id)
    except ReservationFinal:
        state.calls.release(admitted.caller.tenant, admitted.generation.request_id)
        raise _final(admitted.generation.request_id, "closed") from None
    if held is False:
        state.calls.release(admitted.caller.tenant, admitted.generation.request_id)
        raise _in_progress(admitted.generation.request_id, None)


async def renew_run_claim(state: GatewayState, reservation_id: str) -> bool | None:
    """Renew the run claim of a request this process serves, and keep the answer in ``state.calls``: True held,
    False lost (another process holds it), None the ledger cannot say. Raises ``ReservationFinal``: the
    reservation closed (kept as lost)."""
    sent_s = state.clock.monotonic_s()
    try:
        claim = await state.ledger.claim(reservation_id, state.process_id, state.claim_lease_ms)
    except (ReservationFinal, ReservationNotFound) as exc:
        state.calls.run_claim_lost(reservation_id)
        if isinstance(exc, ReservationFinal):
            raise
        return False
    except LedgerError:
        return None
    if not claim.held_by(state.process_id):
        state.calls.run_claim_lost(reservation_id)
        return False
    state.calls.run_claim_held(reservation_id, sent_s + state.claim_lease_ms / 1000.0)
    return True


async def _claim_run(state: GatewayState, request_id: str, reservation: Reservation) -> None:
    """Take the reservation's run claim for this process, on its own (the reserve did not). Raises
    ``Rejection``: 409 when another process holds it (``Retry-After``: until its lease lapses) or the
    reservation closed meanwhile, 503 when the ledger cannot say (running the request then could run it twice)."""
    try:
        claim = await state.ledger.claim(reservation.id, state.process_id, state.claim_lease_ms)
    except ReservationFinal:
        raise _final(request_id, "closed") from None
    except LedgerError as exc:
        log.warning(json.dumps({"event": "claim_failed", "reservation": reservation.id, "error": str(exc)}))
        state.ledger.doubt(reservation.tenant, reservation.request_id)  # cancelled later if nobody runs it
        raise Rejection(Outcome.LEDGER_UNAVAILABLE, "Accounting is unavailable; retry later.") from None
    if not claim.held_by(state.process_id):
        raise _in_progress(request_id, claim.remaining_ms / 1000.0)


async def _close_abandoned(state: GatewayState, request_id: str, reservation: Reservation) -> None:
    """A reservation open with usage billed, whose run claim this process could take: its request ran on a
    process that stopped (the claim lapsed; a call settles at its first token). It is not run again - its
    client received part of it, billed - but closed billing what was settled. Raises ``Rejection`` 409."""
    try:
        await state.ledger.cancel(reservation.id, reservation.billed)
    except LedgerError as exc:  # the sweep expires it at its TTL, billing the same
        log.warning(json.dumps({"event": "settle_failed", "reservation": reservation.id, "error": str(exc)}))
    raise _completed(
        request_id,
        "ran on a gateway process that stopped; it is not run again (what it generated is billed). "
        "Send it with a new request id.",
    )


async def _release_unclaimed(state: GatewayState, reservation: Reservation) -> None:
    """Cancel, billing nothing, a reservation this process may have claimed for a request it will not run:
    if the run claim is (or can now be) this process's, nobody else runs it. Best effort: a ledger that does
    not answer leaves it to expire at its TTL."""
    with contextlib.suppress(LedgerError):
        claim = await state.ledger.claim(reservation.id, state.process_id, state.claim_lease_ms)
        if claim.held_by(state.process_id) and reservation.billed == Usage():
            await state.ledger.cancel(reservation.id, Usage())


def _in_progress(request_id: str, retry_after_s: float | None) -> Rejection:
    return Rejection(
        Outcome.REQUEST_IN_PROGRESS,
        f"Request {request_id!r} is being served already; it is not run twice.",
        "x-request-id",
        retry_after_s=retry_after_s,
    )


def _completed(request_id: str, what: str) -> Rejection:
    """409 ``request_already_completed``: "Request '<id>' <what>"."""
    return Rejection(Outcome.REQUEST_ALREADY_COMPLETED, f"Request {request_id!r} {what}", "x-request-id")


def _final(request_id: str, status: str) -> Rejection:
    return _completed(request_id, f"has completed already ({status}); it is not run or charged again.")


async def release(state: GatewayState, admitted: Admitted) -> None:
    """Give back a reservation whose request never ran (nothing is billed) and forget the request."""
    try:
        await state.ledger.cancel(admitted.reservation.id, Usage())
    except LedgerError as exc:
        log.warning(json.dumps({"event": "release_failed", "reservation": admitted.reservation.id, "error": str(exc)}))
    finally:
        state.calls.release(admitted.caller.tenant, admitted.generation.request_id)


def request_rate_refused(state: GatewayState, tenant: str | None) -> bool:
    """Whether the ledger is bound to refuse ``tenant``'s next request by its request rate (its last refusal
    said when the bucket holds one again, and that time has not come): its prompt need not be counted."""
    until = state.request_rate_refused.get(tenant or "")
    if until is None:
        return False
    if state.clock.monotonic_s() < until:
        return True
    del state.request_rate_refused[tenant or ""]
    return False
