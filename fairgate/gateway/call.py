"""The call, the last stage: one admitted request on the upstream slot it was given, to its end.

A ``Call`` owns everything a request holds while it runs: the slot (``Lease``), the reservation, and its
registration with the upstream's live meter (``CallState``). It sends the body upstream (always streamed,
with usage) and relays the stream to the client (server-sent events) or collects it into one response; the
upstream is read in a task of its own (``ReadAhead``), so what the relay awaits (the ledger, a slow client) does
not move the meter's stamps.
A stream is settled partially at its first token (the ledger then knows the request has run), then every
``SETTLE_EVERY_TOKENS`` tokens or ``SETTLE_EVERY_S``: a gateway killed mid-stream leaves at most that much delivered
and unbilled per request. A collected call delivers nothing before it ends, so it settles only then. A request that
has used the GPU time its reservation holds is stopped once its tenant's GPU budget has nothing left
(``BudgetSpent``: the overspend is at most one settlement interval's charges and a ledger round trip per request),
and so is one generating past its ``max_tokens``; partial settlements and that check run beside the relay, one at a
time. A client that reads nothing for ``READ_AHEAD_STALL_S`` with the read-ahead full has its request stopped
(``ClientStalled``), billed as generated. The slot is free once the upstream has ended. On every path - completed,
client gone, upstream failed, this task cancelled - the call closes the upstream stream (the replica stops the
sequence within an iteration), frees the slot, settles the reservation finally (cancelled ones billed for what was
generated; nothing, when the platform failed before the client received anything) and forgets the request, once: the
settlement runs to its end even when this task is cancelled, and the request is forgotten only after it, so a retry
of its id is never admitted while the ledger still holds the reservation open and unbilled (it would run it again);
one the ledger did not take is remembered (``GatewayState.unsettled``) for the same reason. An upstream failure or a
usage not believed (``usage_rule``) is logged in one warning line naming the upstream. An upstream that refused the
connection before anything was relayed raises ``TryAnotherUpstream`` instead, leaving the reservation open for the
next upstream of the model.

A request of ``n`` choices holds ``n`` slots (one ``Lease``) and is sent upstream with ``n`` and the
per-choice ``max_tokens``; its chunks are relayed as they come (each names its choice's ``index``), a
collected answer has one choice per index, and the output billed is the sum over the choices.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Coroutine
from dataclasses import replace
from typing import Any, TypeVar

import anyio
import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from fairgate.api import GenerationRequest
from fairgate.gateway import kinds
from fairgate.gateway.admission import Admitted, renew_run_claim
from fairgate.gateway.dispatch import Lease
from fairgate.gateway.headers import rate_limit_headers
from fairgate.gateway.observe import Finished, Refunded, Settled
from fairgate.gateway.outcomes import Outcome, Rejection
from fairgate.gateway.readahead import ClientStalled, ReadAhead
from fairgate.gateway.state import GatewayState
from fairgate.gateway.upstream import BudgetSpent, CallState, UpstreamError
from fairgate.gateway.usage_rule import Billed, billed_tokens
from fairgate.ledger import LedgerError, ReservationFinal, Usage, rules
from fairgate.ledger.base import tenant_tag

log = logging.getLogger("fairgate.gateway")
T = TypeVar("T")
# A partial settlement every 64 tokens or 0.5 s, whichever comes first: the bound on what a gateway killed
# mid-stream leaves delivered and unbilled per request (kill -9 with 2 s between settlements lost 24 % of
# 2,714 tokens). At 20-50 tokens/s per stream that is one ledger write per 0.5 s per stream.
SETTLE_EVERY_TOKENS = 64
SETTLE_EVERY_S = 0.5
GPU_MS_BILLED_MAX = 86_400_000.0  # one request is billed at most a day of GPU time
# Chunks that came from the upstream in one read go to the client in one write, up to this many: a write per
# chunk was the relay's largest cost per token (bench/gateway_overhead.py), and a client that hangs up has at
# most this many billed but unread in a write (the history checker allows 8: ``harness.history.Bounds``).
RELAY_CHUNKS_PER_WRITE_MAX = 4


class TryAnotherUpstream(Exception):
    """The upstream refused the connection before anything was relayed, and another one is up."""


class Call:
    """One admitted request on one upstream slot (see module docstring).

    Args:
        state: the gateway's state.
        admitted: the request and its reservation.
        lease: the slot the dispatcher gave it.
        queue_ms: time it waited for the slot.
        may_retry: another upstream may be tried if this one refuses the connection.
    """

    def __init__(self, state: GatewayState, admitted: Admitted, lease: Lease, queue_ms: float, may_retry: bool) -> None:
        self.state, self.admitted, self.lease, self.may_retry = state, admitted, lease, may_retry
        generation = admitted.generation
        self.client = state.upstreams[lease.upstream.name]
        self.progress = CallState(
            f"{generation.request_id}#{uuid.uuid4().hex[:8]}",
            admitted.caller.tenant,
            generation.prompt_tokens,
            sequences=generation.sequences,
            max_output_tokens=admitted.reservation.max_output_tokens,
        )
        self.progress.queue_ms = queue_ms
        self.progress.model, self.progress.upstream = generation.model, lease.upstream.name
        self._ended = False
        self._settled_at = (0, state.clock.monotonic_s())  # (output tokens, time) of the last partial settlement
        self.stopped: str | None = None  # why the gateway stopped the request (``BudgetSpent.code``)
        self.delivered = False  # the client has received something of the generation
        self._billed = Usage()  # what the settlements so far billed (the ledger's amounts are cumulative)
        self._usage_chunk: dict[str, Any] | None = None  # the upstream's last usage chunk, less choices and usage
        self._claim_renewed_s = -math.inf  # when the relay last asked the ledger to renew its lapsed run claim
        self._checking: asyncio.Future[None] | None = None  # the partial settlement and budget check under way
        self._stop: BudgetSpent | None = None  # what that check found: the upstream is cut at its next read
        self._settle_again = False  # settle once more when the check under way ends (the upstream has ended)

    async def respond(self, request: Request) -> Response:
        """Run the call and answer the client: a relayed stream, or one collected response. Raises
        ``Rejection`` (the upstream failed before anything was relayed, or the client left) or
        ``TryAnotherUpstream``."""
        generation = self.admitted.generation
        path = "/chat/completions" if generation.chat else "/completions"
        headers = {"x-request-id": generation.request_id, **self._rate_headers()}
        upstream = self.client.stream(path, self._upstream_body(), self.progress, self.lease.prefill_estimate_ms)
        # The meter stamps tokens as they arrive whatever the relay awaits; the call is settled as the upstream
        # generates and its slot is free once the upstream ended, however fast the client reads.
        stream = ReadAhead(upstream, self.progress, on_end=self._upstream_ended, on_read=self._upstream_read)
        body = generation.body
        if isinstance(body, GenerationRequest) and body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            relay = self._relay(stream, include_usage)
            # Start the relay before answering: an upstream that fails at once gets an HTTP error status, and
            # the relay's clean-up (slot, settlement) is armed even if the client leaves before the body
            # starts (asyncio finalizes a started generator; one never started would hold its slot forever).
            # Until then the client is watched as a collected call's is: one that leaves before the first token
            # stops the call at once (billed what was generated, nothing received), not at that token.
            first = await while_connected(request, _first(relay))
            return RelayedStream(first, relay, headers)
        document = await while_connected(request, self._collect(stream))
        if self.stopped is not None:
            headers["x-fairgate-stop-reason"] = self.stopped
        return JSONResponse(document, headers=headers)

    def _upstream_body(self) -> dict[str, Any]:
        """The body the upstream gets: the client's fields its kind forwards (``kinds.upstream_body``: the
        gateway's own fields such as ``user`` or ``priority`` dropped, the tenant's cache isolation set), with
        the output cap the reservation holds as ``max_tokens``."""
        generation = self.admitted.generation
        body = generation.body.model_dump(exclude_none=True)
        body["max_tokens"] = generation.max_tokens // generation.sequences  # per choice; reserved for all n
        body.pop("max_completion_tokens", None)
        out = kinds.upstream_body(self.client.kind, body, generation.chat, tenant_tag(self.admitted.caller.tenant))
        out["model"] = self.lease.upstream.model  # the engine's name: an alias is the gateway's, not its
        return out

    def _rate_headers(self) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers: limits from the config, what remains from the balances the
        reservation returned (omitted for an emergency grant, which has none)."""
        tenant, model = self.admitted.caller.tenant, self.admitted.generation.model_class
        try:
            limits = self.state.config.quotas.tenant(tenant).for_model_class(model)
        except KeyError:
            return {}
        return rate_limit_headers(limits, self.admitted.reservation.balances, self.state.wall_ms())

    async def _relay(self, stream: ReadAhead, include_usage: bool) -> AsyncIterator[str]:
        """The client's server-sent events; settles partially while it runs and ends the call on every path.
        A client that asked for usage gets it last, before ``[DONE]``, as billed (``_usage_event``)."""
        finished = sent = retrying = False
        pending: list[str] = []  # events of chunks from the same upstream read, not yet written
        try:
            async for chunk in stream:
                self._hold_run_claim()
                event = self._client_event(chunk)
                if event is not None:
                    pending.append(event)
                if pending and (not stream.more or len(pending) >= RELAY_CHUNKS_PER_WRITE_MAX):
                    if not self.delivered:  # checked here, not awaited: this runs once per write
                        await self._record_run()
                    yield _written(pending)
                    sent = self.delivered = True
            if pending:
                await self._record_run()
                yield _written(pending)
                sent = self.delivered = True
            finished = True
            await self._end(stream, finished, retrying)  # settled before the client reads its usage and [DONE]
            yield (self._usage_event() if include_usage else "") + "data: [DONE]\n\n"
        except BudgetSpent as exc:  # raised after every chunk read before the stop: relayed, as they are billed
            if pending:
                await self._record_run()
                yield _written(pending)
                sent = self.delivered = True
            finished = True
            await self._end(stream, finished, retrying)  # settled before the client reads why it stopped
            yield (self._usage_event() if include_usage else "") + exc.sse_event()
        except ClientStalled as exc:  # the upstream was cut: billed as generated, as a client that left
            if pending:
                await self._record_run()
                yield _written(pending)
                sent = self.delivered = True
            await self._end(stream, finished, retrying)
            yield exc.sse_event()
        except UpstreamError as exc:
            self.progress.failed, self.progress.failure = True, exc
            if pending:  # the chunks read before the one that broke are the client's (and billed)
                await self._record_run()
                yield _written(pending)
                sent = self.delivered = True
            if not sent and self._another_upstream(exc):
                retrying = True
                raise TryAnotherUpstream() from None
            if not sent:  # nothing relayed yet: the client gets a plain HTTP error
                raise upstream_failed(exc) from None
            error = {"error": {"message": str(exc), "type": "server_error", "param": None, "code": "upstream_error"}}
            yield f"data: {json.dumps(error)}\n\n"
        finally:
            await self._end(stream, finished, retrying)

    def _hold_run_claim(self) -> None:
        """Before a chunk goes on: the request's run claim must not be known lost. One lapsed by this process's
        clock (``CallRegistry.run_claim_left_s``: paused, or the ledger slow or out of reach for a lease) is
        renewed in a task of its own, at most once a third of the lease, so the stream goes on meanwhile: a ledger
        outage must not stop it, and nobody can take its claim then. Once the ledger says another process holds
        the claim or the reservation closed, a retry elsewhere may run or have closed it: the call stops as a
        platform failure, billed what the client received if the ledger still takes it. An outside tester paused
        a process for 4.5 s mid-stream: the retry closed the reservation, and the resumed stream delivered 150
        tokens billed 1. Raises ``UpstreamError``."""
        now_s = self.state.clock.monotonic_s()
        left_s = self.state.calls.run_claim_left_s(self.admitted.reservation.id, now_s)
        if left_s >= 0:
            return
        if left_s == -math.inf:
            raise UpstreamError(
                "The gateway process lost this request's run claim (paused, or cut off from its ledger); it was "
                "stopped.",
                status=503,
                problem="run_claim_lost",
            )
        if now_s - self._claim_renewed_s >= self.state.claim_lease_ms / 3000.0:
            self._claim_renewed_s = now_s
            self.state.spawn(_renew_quietly(self.state, self.admitted.reservation.id))

    def _client_event(self, chunk: dict[str, Any]) -> str | None:
        """The event that relays ``chunk`` to the client, or None when nothing of it is the client's (a usage
        chunk: the client gets usage as billed, at the end). The model is the name the client asked for, not
        the engine's behind an alias."""
        usage = chunk.pop("usage", None)
        if usage is not None:
            self._usage_chunk = {k: v for k, v in chunk.items() if k != "choices"}
            if not chunk.get("choices"):
                return None
        if "model" in chunk:
            chunk["model"] = self.admitted.generation.model
        return f"data: {orjson.dumps(chunk).decode()}\n\n"

    def _usage_event(self) -> str:
        """The usage event of a stream whose client asked for it (``stream_options.include_usage``): what the
        final settlement billed, in the upstream's last usage chunk's frame (OpenAI's: no choices)."""
        billed = self._billed
        usage: dict[str, Any] = {
            "prompt_tokens": billed.input_tokens,
            "completion_tokens": billed.output_tokens,
            "total_tokens": billed.input_tokens + billed.output_tokens,
        }
        if self.progress.cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": self.progress.cached_tokens}
        generation = self.admitted.generation
        frame: dict[str, Any] = {
            "id": generation.request_id,
            "object": "chat.completion.chunk" if generation.chat else "text_completion",
            "created": int(self.state.clock.wall_s()),
        }
        frame |= self._usage_chunk or {}
        frame |= {"model": generation.model, "choices": [], "usage": usage}
        return f"data: {json.dumps(frame)}\n\n"

    async def _collect(self, stream: ReadAhead) -> dict[str, Any]:
        """Read the whole stream; the client's one response document."""
        finished = retrying = False
        try:
            async for _ in stream:
                self._hold_run_claim()
            finished = True
        except BudgetSpent as exc:
            finished, self.stopped, self.progress.finish_reason = True, exc.code, "length"
        except UpstreamError as exc:
            self.progress.failed, self.progress.failure = True, exc
            if not self.progress.output_tokens and self._another_upstream(exc):
                retrying = True
                raise TryAnotherUpstream() from None
            raise upstream_failed(exc) from None
        finally:
            await self._end(stream, finished, retrying)
        generation = self.admitted.generation
        return completion_document(self.progress, generation.chat, generation.model, int(self.state.clock.wall_s()))

    def _another_upstream(self, exc: UpstreamError) -> bool:
        """Send the request to another upstream? Only if this one never saw it and another one of its pools
        (the primary's or an approved fallback's) is up."""
        mine, pools = self.lease.upstream, self.admitted.generation.pools
        return (
            self.may_retry
            and exc.unreachable
            and any(u.serving for u in self.state.dispatcher.upstreams() if u.pool in pools and u is not mine)
        )

    async def _end(self, stream: ReadAhead | AsyncGenerator[Any, None], finished: bool, retrying: bool) -> None:
        """Close the upstream stream, free the slot, settle finally and then forget the request - unless it
        goes on, under the same reservation, on another upstream. Once; runs to the end even if this task is
        cancelled (the client left): the final settlement runs in a task of its own (``run_to_end``)."""
        if self._ended:
            return
        self._ended = True
        with anyio.CancelScope(shield=True):
            try:
                try:
                    await stream.aclose()
                finally:  # a cancellation (asyncio's own: the shield does not stop it) must not keep the slot
                    self.state.dispatcher.release(self.lease, self.progress.output_tokens)
            finally:  # whatever went wrong above, the request is settled, then forgotten
                if not retrying:
                    await run_to_end(self._settle_finally(cancelled=not finished))

    async def _settle_finally(self, cancelled: bool) -> None:
        """The final settlement, then forget the request: only then may a retry of its id be admitted here
        (admitted while the reservation is still open and unbilled, it would be run again). A call cut in a step
        is settled once it has left the meter, at that step's end (``CallState.leaving``)."""
        try:
            if self._checking is not None:  # amounts are cumulative: the partial settlement goes first
                await asyncio.wait({self._checking})
            if self.progress.leaving is not None:
                await self.progress.leaving
            await self._settle(final=True, cancelled=cancelled)
        finally:
            self.state.calls.release(self.admitted.caller.tenant, self.admitted.generation.request_id)
            self.state.events.observe(Settled(self.admitted.generation.request_id, self.state.clock.wall_s()))

    async def _record_run(self) -> None:
        """Before a stream's first write to its client: settle what it generated so far, so that the ledger knows
        the request ran before the client sees any of it. A gateway killed after that write leaves a reservation
        that billed tokens, and a retry of its id on another process is refused (never run twice); were it
        settled after the write, a kill in between would leave it open and unbilled, and a retry would run it
        again."""
        if self.delivered:
            return
        self._settled_at = (self.progress.output_tokens, self.state.clock.monotonic_s())
        await self._settle(final=False, cancelled=False)

    def _checkpoint(self, force: bool = False) -> None:
        """After each upstream read (``_upstream_read``): at its first token and then every ``SETTLE_EVERY_TOKENS``
        tokens or ``SETTLE_EVERY_S`` (or now, ``force``), settle a stream partially and, once it has used the GPU
        time its reservation holds, check its tenant's budgets (``_check``) - beside the relay, one check at a time,
        at the pace of the upstream: a relay that awaited them read its upstream late, a ledger that answered slowly
        or not at all (timeouts of 1-5 s at every settlement) slowed every stream to a write per timeout, and a
        client that stopped reading stopped them (a kill then left 45 % of its GPU time unbilled)."""
        if self._checking is not None and not self._checking.done():
            self._settle_again = self._settle_again or force
            return
        if not (force or self._checkpoint_due()):
            return
        call, reservation = self.progress, self.admitted.reservation
        self._settled_at = (call.output_tokens, self.state.clock.monotonic_s())
        self._checking = asyncio.ensure_future(self._check(call.gpu_ms > reservation.gpu_ms_estimate))

    async def _check(self, over_estimate: bool) -> None:
        """A partial settlement (a stream: a collected call delivers nothing until it ends, and is not billed before
        then: a platform failure refunds it all); then, when the call ran ``over_estimate``, stop it
        (``self._stop``: the upstream is cut at its next read) if its tenant's GPU or spend budget has nothing left:
        the overspend is at most one settlement interval's charges and a ledger round trip per request."""
        call = self.progress
        if self.admitted.generation.stream:
            await self._settle(final=False, cancelled=False)
            while self._settle_again and not self._ended:
                self._settle_again = False
                self._settled_at = (call.output_tokens, self.state.clock.monotonic_s())
                await self._settle(final=False, cancelled=False)
        if over_estimate:
            gpu_left_ms, spend_left_micros = await self._budgets_left()
            if gpu_left_ms <= 0 or spend_left_micros <= 0:
                what = "GPU" if gpu_left_ms <= 0 else "spend"
                self._stop = BudgetSpent(
                    f"{what.lower()}_budget_exhausted",
                    f"The tenant's {what} budget is spent: the request was stopped after {call.output_tokens} "
                    "tokens (billed as generated).",
                )

    def _upstream_read(self) -> BudgetSpent | None:
        """After each upstream read (``ReadAhead``): the checkpoint, once a stream's client has the first token
        (a collected call's at once); the budget stop, if a check found one (the upstream is cut there, whether or
        not the client reads, and the stop comes after the chunks read before it)."""
        if self.delivered or not self.admitted.generation.stream:
            self._checkpoint()
        return self._stop

    def _upstream_ended(self) -> None:
        """The upstream stream has ended: free its slot (idempotent); a stream whose client has not read it all
        by ``SETTLE_EVERY_S`` later is settled partially then, with all it generated."""
        self.state.dispatcher.release(self.lease, self.progress.output_tokens)
        if self.delivered and not self._ended:
            asyncio.get_running_loop().call_later(SETTLE_EVERY_S, self._settle_up)

    def _settle_up(self) -> None:
        if not self._ended:
            self._checkpoint(force=True)

    def _checkpoint_due(self) -> bool:
        """Whether ``_checkpoint`` has anything to do now: the first token, or ``SETTLE_EVERY_TOKENS`` tokens or
        ``SETTLE_EVERY_S`` since the last partial settlement."""
        tokens, at_s = self._settled_at
        output_tokens = self.progress.output_tokens
        if tokens == 0 < output_tokens:  # the ledger learns at once that the request has run
            return True
        return output_tokens - tokens >= SETTLE_EVERY_TOKENS or self.state.clock.monotonic_s() - at_s >= SETTLE_EVERY_S

    async def _budgets_left(self) -> tuple[float, float]:
        """GPU ms and spend micros the tenant's budgets leave now (``rules.gpu_left_ms``,
        ``rules.spend_left_micros``): only GPU time run past the estimate can overspend either, since the rest
        of the worst case is held; ``inf`` when the ledger cannot say (its outage policy bounds what runs
        meanwhile)."""
        tenant, model = self.admitted.caller.tenant, self.admitted.generation.model_class
        gpu_left, spend_left = math.inf, math.inf
        try:  # the tenant-wide budgets, and the model class's when it has its own (``TenantQuota.accounts``)
            for key, limits in self.state.config.quotas.tenant(tenant).accounts(model):
                account = rules.refreshed(await self.state.ledger.account(tenant, key), limits, self.state.wall_ms())
                gpu_left = min(gpu_left, rules.gpu_left_ms(account, limits))
                spend_left = min(spend_left, rules.spend_left_micros(account, limits))
        except (KeyError, LedgerError):
            return math.inf, math.inf
        if not self.admitted.generation.stream:  # the ledger holds its estimate; the rest is not booked yet
            unbooked_ms = max(0.0, self.progress.gpu_ms - self.admitted.reservation.gpu_ms_estimate)
            gpu_left -= unbooked_ms
            spend_left -= unbooked_ms * self.admitted.reservation.price.gpu_micros_per_ms
        return gpu_left, spend_left

    async def _settle(self, final: bool, cancelled: bool) -> None:
        """Book what the call used so far: the upstream's usage where it is believed, else what was relayed
        (``usage_rule``), and the metered GPU time (cumulative); ``final`` releases the rest of the
        reservation. A call that failed on the platform's side before the client received anything is not
        the tenant's to pay: its reservation is cancelled billing nothing (``_refund``)."""
        call, reservation = self.progress, self.admitted.reservation
        if final and call.failed and not self.delivered:
            await self._refund()
            return
        generation = self.admitted.generation
        billed = billed_tokens(
            call, reservation.max_output_tokens, generation.prompt_tokens_estimated, generation.prompt_tokens_max
        )
        # A call the upstream failed is billed the GPU time up to its last token: a stall until the idle
        # timeout, or the wait for bytes that never came, delivered nothing.
        gpu_ms = min(call.gpu_ms_at_last_token if call.failed else call.gpu_ms, GPU_MS_BILLED_MAX)
        if not final:  # its prefill is billed at the end, less what the engine's prefix cache spared it
            gpu_ms = max(0.0, gpu_ms - call.prefill_held_ms)
        # A partial settlement billed the prompt estimate and the pieces relayed before the upstream reported
        # usage; the ledger refuses a lower cumulative amount (which would leave the reservation open to
        # expire), so what was billed stays billed.
        done = self._billed
        billed = replace(
            billed,
            input_tokens=max(billed.input_tokens, done.input_tokens),
            output_tokens=max(billed.output_tokens, done.output_tokens),
        )
        input_tokens, output_tokens, gpu_ms = billed.input_tokens, billed.output_tokens, max(gpu_ms, done.gpu_ms)
        self._billed = Usage(input_tokens, output_tokens, gpu_ms)
        if final:
            self._log_final(billed, gpu_ms)
            # A collected call's document shows what is billed, never the upstream's count where it differs.
            call.usage = {**(call.usage or {}), **billed.usage(), "total_tokens": input_tokens + output_tokens}
            outcome = "cancelled" if cancelled else "completed"
            self.state.events.observe(self._finished(outcome, input_tokens, output_tokens, gpu_ms))
        try:
            if cancelled:
                await self.state.ledger.cancel(reservation.id, Usage(input_tokens, output_tokens, gpu_ms))
            else:
                await self.state.ledger.settle(reservation.id, input_tokens, output_tokens, gpu_ms, final)
        except LedgerError as exc:
            if final:  # the ledger does not know this run ended (nor, for a collected call, that it ran)
                self.state.unsettled.add(reservation.id)
                self.state.unsettled_requests.add((reservation.tenant, reservation.request_id))
            log.warning(json.dumps({"event": "settle_failed", "reservation": reservation.id, "error": str(exc)}))

    def _log_final(self, billed: Billed, gpu_ms: float) -> None:
        """The one warning of a final settlement that needs one: the upstream failed after the client had
        received part of the stream (``upstream_failed``), or its usage was not believed
        (``usage_contradicts_relay``), or its prompt was far above the reservation's estimate and is billed as
        reported (``usage_above_reservation``: ``rules.input_allowance``)."""
        call, reservation = self.progress, self.admitted.reservation
        line: dict[str, Any] = {"reservation": reservation.id, "request_id": reservation.request_id}
        line["upstream"] = call.upstream
        billed_counts = {"input_tokens": billed.input_tokens, "output_tokens": billed.output_tokens}
        if call.failed:
            line = {**self._failure_line(delivered=True), "billed": {**billed_counts, "gpu_ms": gpu_ms}}
        elif billed.contradicted:
            line = {"event": "usage_contradicts_relay", **line, "reported": billed.contradicted}
            line |= {"relayed_tokens": call.output_tokens, "generated_bytes": call.generated_bytes}
            line |= {"estimated_input_tokens": call.prompt_tokens, "billed": billed_counts}
        elif billed.input_tokens > rules.input_allowance(reservation.input_tokens):
            line = {"event": "usage_above_reservation", **line, "input_tokens": billed.input_tokens}
            line["reserved_input_tokens"] = reservation.input_tokens
        else:
            return
        if call.failed and billed.contradicted:
            line["usage_contradicted"] = billed.contradicted
        log.warning(json.dumps(line))

    async def _refund(self) -> None:
        """Cancel the reservation of a call the upstream failed (refused, died, stalled, sent what is not an
        OpenAI stream) before the client received anything, billing nothing; one warning names the upstream,
        what it did wrong and what the call used (``upstream_failed``); the fair policy keeps the GPU time it
        charged (the replica did spend it), and the client's 5xx is counted as a rejection."""
        call, reservation = self.progress, self.admitted.reservation
        line = self._failure_line(delivered=False)
        refund = Refunded(
            reservation.request_id,
            call.tenant,
            call.upstream,
            line["problem"],
            call.prompt_tokens,
            call.output_tokens,
            call.gpu_ms,
            self.state.clock.wall_s(),
        )
        self.state.events.observe(refund)
        self.state.events.observe(self._finished("error", 0, 0, 0.0))
        used = {"input_tokens": call.prompt_tokens, "output_tokens": call.output_tokens, "gpu_ms": call.gpu_ms}
        log.warning(json.dumps({**line, "unbilled": used}))
        try:
            await self.state.ledger.cancel(reservation.id, Usage())
        except LedgerError as exc:
            log.warning(json.dumps({"event": "settle_failed", "reservation": reservation.id, "error": str(exc)}))

    def _failure_line(self, delivered: bool) -> dict[str, Any]:
        """The ``upstream_failed`` warning's fields: which upstream, what it did wrong (``UpstreamError.problem``,
        its message, a sample of what it sent) and whether the client had received part of the stream."""
        call, reservation, failure = self.progress, self.admitted.reservation, self.progress.failure
        return {
            "event": "upstream_failed",
            "reservation": reservation.id,
            "request_id": reservation.request_id,
            "upstream": call.upstream,
            "problem": failure.problem if failure else "failed",
            "error": str(failure),
            "sent": failure.sample if failure else "",
            "delivered": delivered,
        }

    def _finished(self, outcome: str, input_tokens: int, output_tokens: int, gpu_ms: float) -> Finished:
        call, reservation = self.progress, self.admitted.reservation
        ttft_ms = tpot_ms = None
        if call.first_token_s is not None:
            ttft_ms = (call.first_token_s - call.started_s) * 1000.0
            if output_tokens > 1 and call.last_token_s is not None:
                tpot_ms = (call.last_token_s - call.first_token_s) * 1000.0 / (output_tokens - 1)
        return Finished(
            reservation.request_id,
            call.tenant,
            call.model,
            call.upstream,
            "error" if call.failed else outcome,
            call.queue_ms,
            ttft_ms,
            tpot_ms,
            input_tokens,
            output_tokens,
            gpu_ms,
            reservation.gpu_ms_estimate,
            reservation.max_output_tokens,
            self.state.clock.wall_s(),
            reservation.price.spend_micros(input_tokens, output_tokens, gpu_ms),
            call.cached_tokens,
            call.cache_credit_ms,
        )


def upstream_failed(exc: UpstreamError) -> Rejection:
    """The client's answer to an upstream that failed before the client received anything: a prompt over its
    context is OpenAI's ``context_length_exceeded``; a request it refused with its own OpenAI error is answered
    with that error's status, message, type, param and code (the client's to fix: a dimension the model does
    not have, a value the engine holds out of range); the rest are the gateway's ``upstream_error``."""
    if exc.context_exceeded:  # the client's prompt, not the platform: OpenAI's context_length_exceeded
        return Rejection(Outcome.UPSTREAM_CONTEXT_EXCEEDED, str(exc))
    if exc.refusal is not None:
        said = exc.refusal
        return Rejection(
            Outcome.UPSTREAM_REFUSED,
            said["message"],
            said["param"],
            status=exc.status,
            relayed=(said["type"], said["code"]),
        )
    return Rejection(Outcome.UPSTREAM_ERROR, str(exc), status=exc.status)


def completion_document(call: CallState, chat: bool, model: str, created_s: int) -> dict[str, Any]:
    """The OpenAI response of a collected call: its choices (``index`` 0 to ``n - 1``), each with its text and
    finish reason, and usage (output: summed over the choices)."""
    usage = call.usage or {
        "prompt_tokens": call.prompt_tokens,
        "completion_tokens": call.output_tokens,
        "total_tokens": call.prompt_tokens + call.output_tokens,
    }
    choices = []
    for index in range(call.sequences):
        text = "".join(call.texts.get(index, ()))
        reason = call.finish_reasons.get(index) or call.finish_reason or "stop"
        choice: dict[str, Any] = {"index": index, "finish_reason": reason, "logprobs": None}
        if chat:
            choice["message"] = _message(call, index, text)
        else:
            choice["text"] = text
        choices.append(choice)
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if chat else "text_completion",
        "created": created_s,
        "model": model,
        "choices": choices,
        "usage": usage,
    }


def _message(call: CallState, index: int, text: str) -> dict[str, Any]:
    """A collected chat choice's message: its content, and what else it generated (and was billed for): its
    reasoning (as vLLM and SGLang name it, ``reasoning_content``) and its tool calls (content null beside
    them, as OpenAI's)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if call.reasoning.get(index):
        message["reasoning_content"] = "".join(call.reasoning[index])
    if call.tool_calls.get(index):
        message["tool_calls"] = [{"type": "function", **tool} for _, tool in sorted(call.tool_calls[index].items())]
        message["content"] = text or None
    return message


async def _renew_quietly(state: GatewayState, reservation_id: str) -> None:
    """``admission.renew_run_claim``, its answer kept in ``state.calls`` (a closed reservation: lost)."""
    with contextlib.suppress(ReservationFinal):
        await renew_run_claim(state, reservation_id)


async def while_connected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """What ``work`` returns, run as a task of its own that is cancelled if the client disconnects first
    (``watch_disconnect``, whose first look is one interval in: the queue looked just before the call began,
    ``queueing.wait_for_slot``, and a look costs ~50 µs, a call of 16 tokens ~1.5 % of its CPU). Raises
    ``Rejection`` 499 when the client left."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(watch_disconnect(request, task, first_look_now=False))
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done():  # the client went away: nobody is left to answer
            raise Rejection(Outcome.CLIENT_CLOSED, "client closed the request") from None
        raise
    finally:
        watcher.cancel()


async def watch_disconnect(
    request: Request, work: asyncio.Future[Any], interval_s: float = 0.05, first_look_now: bool = True
) -> None:
    """Cancel ``work`` when the client disconnects (checked every ``interval_s`` seconds; the first time at once,
    or after ``interval_s`` when not ``first_look_now``)."""
    if not first_look_now:
        await asyncio.sleep(interval_s)
    while not work.done():
        if await request.is_disconnected():
            work.cancel()
            return
        await asyncio.sleep(interval_s)


async def run_to_end(work: Coroutine[Any, Any, T]) -> T:
    """Run ``work`` to its end in a task of its own, even if the calling task is cancelled meanwhile; such a
    cancellation is raised once ``work`` has ended.

    An anyio shielded scope does not do this: on a plain asyncio task (a collected call's, which
    ``watch_disconnect`` cancels when its client leaves) ``Task.cancel`` still interrupts what it shields, and a
    final settlement cancelled on its way to the ledger is never written - its reservation stays open and
    unbilled, and a retry of the request id would run it again."""
    task = asyncio.ensure_future(work)
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.wait({task})  # cancelling this wait does not cancel ``task``
        except asyncio.CancelledError as exc:
            cancelled = exc
    if cancelled is not None:
        raise cancelled
    return task.result()


async def _first(relay: AsyncIterator[str]) -> str:
    """The relay's first write (``while_connected`` takes a coroutine)."""
    return await relay.__anext__()


def _written(pending: list[str]) -> str:
    """``pending``'s events as one write; ``pending`` is emptied (a write is never sent twice)."""
    text = "".join(pending)
    pending.clear()
    return text


async def _value(first: str) -> str:
    return first


class _Prepended:
    """``first``, then the pieces of ``rest``: an async iterator that hands on ``rest``'s own awaitables, with no
    generator frame of its own to resume between the relay and the response once a write."""

    def __init__(self, first: str, rest: AsyncIterator[str]) -> None:
        self._first: str | None = first
        self._rest = rest

    def __aiter__(self) -> _Prepended:
        return self

    def __anext__(self) -> Awaitable[str]:
        if self._first is None:
            return self._rest.__anext__()
        first, self._first = self._first, None
        return _value(first)


class RelayedStream(StreamingResponse):
    """The SSE response of a relayed stream; when the response ends - sent, failed, or its client gone at
    any point - the relay is closed, which runs its clean-up (slot, settlement) at once rather than
    whenever the garbage collector finalizes it."""

    def __init__(self, first: str, relay: AsyncIterator[str], headers: dict[str, str]) -> None:
        super().__init__(_Prepended(first, relay), media_type="text/event-stream", headers=headers)
        self._relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._relay.aclose()  # type: ignore[attr-defined]
