"""Waiting for a slot: an admitted request in its tenant's queue until the fair policy gives it one.

A request that cannot have a slot at once takes a place in its tenant's queue bound in the ledger
(``max_queued``, global across gateway processes) and gives it back, off the request path, once it has a
slot (if that is lost, its final settlement gives it back). A client that leaves while its request waits
takes it out of the queue (checked every ``DISCONNECT_CHECK_S``, and once more when it gets its slot: a
request whose client left since the last check is not sent - after a mass hang-up the slots would otherwise
go to a batch of prefills nobody reads). Every refusal releases the reservation first (the request never
ran: nothing is billed).
"""

from __future__ import annotations

import asyncio

import anyio
from fastapi import Request

from fairgate.gateway import admission
from fairgate.gateway.admission import Admitted
from fairgate.gateway.call import watch_disconnect
from fairgate.gateway.dispatch import Lease, NoUpstream, QueueFull
from fairgate.gateway.headers import quota_headers
from fairgate.gateway.observe import Dispatched, Left
from fairgate.gateway.outcomes import Outcome, Rejection
from fairgate.gateway.state import GatewayState
from fairgate.ledger import QuotaExceeded

DISCONNECT_CHECK_S = 0.25
LOCAL_QUEUE_FULL_RETRY_S = 2.0  # the wait suggested when this process's own queue bound is reached


async def wait_for_slot(state: GatewayState, request: Request, admitted: Admitted) -> tuple[Lease, float]:
    """Queue ``admitted`` until it has a slot; returns the lease and the ms it waited. Raises ``Rejection``
    (429 queue full, 503 no upstream up, 499 the client left), the reservation released."""
    generation = admitted.generation
    policy_request = state.dispatcher.request(
        admitted.caller.tenant, generation.prompt_tokens, generation.max_tokens, generation.sequences
    )
    queued_at_s = state.clock.monotonic_s()
    waited = False

    async def take_queue_place() -> None:
        nonlocal waited
        waited = True
        await state.ledger.enqueue(admitted.reservation.id)

    waiting = asyncio.ensure_future(state.dispatcher.acquire(policy_request, generation.pools, take_queue_place))
    watcher = asyncio.ensure_future(watch_disconnect(request, waiting, DISCONNECT_CHECK_S))
    try:
        lease = await waiting
    except asyncio.CancelledError:
        with anyio.CancelScope(shield=True):
            await admission.release(state, admitted)
        if watcher.done() and not watcher.cancelled():  # the watcher ended the wait: the client left
            _left(state, admitted, queued_at_s)
            raise Rejection(Outcome.CLIENT_CLOSED, "client closed the request while it was queued") from None
        raise
    except (QuotaExceeded, QueueFull, NoUpstream) as exc:
        await admission.release(state, admitted)
        raise _refused(exc, generation.model) from None
    finally:
        watcher.cancel()
    if await request.is_disconnected():  # the client left since the watcher's last look: the slot goes on
        state.dispatcher.release(lease, 0)
        with anyio.CancelScope(shield=True):
            await admission.release(state, admitted)
        _left(state, admitted, queued_at_s)
        raise Rejection(Outcome.CLIENT_CLOSED, "client closed the request while it was queued")
    if waited:
        state.spawn(state.ledger.dequeue(admitted.reservation.id))
    try:
        await admission.hold_run_claim(state, admitted)
    except BaseException:
        state.dispatcher.release(lease, 0)
        raise
    queue_ms = (state.clock.monotonic_s() - queued_at_s) * 1000.0
    state.events.observe(
        Dispatched(
            generation.request_id,
            admitted.caller.tenant,
            generation.model,
            lease.upstream.name,
            queue_ms,
            state.clock.wall_s(),
        )
    )
    return lease, queue_ms


def _left(state: GatewayState, admitted: Admitted, queued_at_s: float) -> None:
    """Tell the observers the client left while queued (``Left``: the request's last event)."""
    queue_ms = (state.clock.monotonic_s() - queued_at_s) * 1000.0
    generation = admitted.generation
    event = Left(generation.request_id, admitted.caller.tenant, generation.model, queue_ms, state.clock.wall_s())
    state.events.observe(event)


def _refused(exc: QuotaExceeded | QueueFull | NoUpstream, model: str) -> Rejection:
    if isinstance(exc, QuotaExceeded):  # the ledger's queue bound, across every gateway process
        return Rejection(
            Outcome.QUEUE_FULL,
            f"Too many requests queued for this tenant ({exc.limit:g}, all gateway processes).",
            retry_after_s=exc.retry_after_s,
            dimension=exc.dimension,
            headers=quota_headers(exc),
        )
    if isinstance(exc, QueueFull):
        return Rejection(
            Outcome.QUEUE_FULL,
            f"Too many requests queued for this tenant ({exc.limit}).",
            retry_after_s=LOCAL_QUEUE_FULL_RETRY_S,
        )
    return Rejection(Outcome.NO_UPSTREAM, f"No upstream is available for {model!r}.")
