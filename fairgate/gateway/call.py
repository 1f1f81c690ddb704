"""The call, the last stage: one admitted request on the upstream slot it was given, to its end.

A ``Call`` owns everything a request holds while it runs: the slot (``Lease``), the reservation, and its
registration with the upstream's live meter (``CallState``). It sends the body upstream (always streamed,
with usage) and relays the stream to the client (server-sent events) or collects it into one response.
A stream is settled partially at its first token (the ledger then knows the request has run), then every
``SETTLE_EVERY_TOKENS`` tokens or ``SETTLE_EVERY_S``: a gateway killed mid-stream leaves at most that much
delivered and unbilled per request. A collected call delivers nothing before it ends, so it settles only
then. A request that has used the GPU time its reservation holds is stopped once its tenant's GPU budget has
nothing left (``BudgetSpent``: the overspend is at most one settlement interval's charges per request), and
so is one generating past its ``max_tokens``. On every path - completed, client gone, upstream failed, this
task cancelled - the call closes the upstream stream (the replica stops the sequence within an iteration),
frees the slot, settles the reservation finally (cancelled ones billed for what was generated; nothing, when
the platform failed before the client received anything) and forgets the request, once. An upstream that
refused the connection before anything was relayed raises ``TryAnotherUpstream`` instead, leaving the
reservation open for the next upstream of the model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from fairgate.gateway import kinds
from fairgate.gateway.admission import Admitted
from fairgate.gateway.dispatch import Lease
from fairgate.gateway.headers import rate_limit_headers
from fairgate.gateway.observe import Finished
from fairgate.gateway.outcomes import Outcome, Rejection
from fairgate.gateway.state import GatewayState
from fairgate.gateway.upstream import CallState, UpstreamError, billable_usage
from fairgate.ledger import LedgerError, Usage, rules
from fairgate.ledger.base import tenant_tag

log = logging.getLogger("fairgate.gateway")
# A partial settlement every 64 tokens or 0.5 s, whichever comes first: the bound on what a gateway killed
# mid-stream leaves delivered and unbilled per request (kill -9 with 2 s between settlements lost 24 % of
# 2,714 tokens). At 20-50 tokens/s per stream that is one ledger write per 0.5 s per stream.
SETTLE_EVERY_TOKENS = 64
SETTLE_EVERY_S = 0.5
BALANCES_WAIT_S = 0.25  # the rate-limit headers wait this long for the balances read, then go without
GPU_MS_BILLED_MAX = 86_400_000.0  # one request is billed at most a day of GPU time


class TryAnotherUpstream(Exception):
    """The upstream refused the connection before anything was relayed, and another one is up."""


class BudgetSpent(Exception):
    """The request is stopped: its tenant's GPU budget has nothing left, or the upstream generated past the
    request's ``max_tokens``. ``code`` names which; the message is the client's."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code

    def sse_event(self) -> str:
        """The terminal server-sent event of a stream it stops (an OpenAI error object)."""
        error = {"message": str(self), "type": "insufficient_quota", "param": None, "code": self.code}
        return f"data: {json.dumps({'error': error})}\n\n"


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
            f"{generation.request_id}#{uuid.uuid4().hex[:8]}", admitted.caller.tenant, generation.prompt_tokens
        )
        self.progress.queue_ms = queue_ms
        self.progress.model, self.progress.upstream = generation.model, lease.upstream.name
        self._ended = False
        self._settled_at = (0, state.clock.monotonic_s())  # (output tokens, time) of the last partial settlement
        self.stopped: str | None = None  # why the gateway stopped the request (``BudgetSpent.code``)
        self.delivered = False  # the client has received something of the generation

    async def respond(self, request: Request) -> Response:
        """Run the call and answer the client: a relayed stream, or one collected response. Raises
        ``Rejection`` (the upstream failed before anything was relayed, or the client left) or
        ``TryAnotherUpstream``."""
        generation = self.admitted.generation
        path = "/chat/completions" if generation.chat else "/completions"
        headers = {"x-request-id": generation.request_id, **await self._rate_headers()}
        stream = self.client.stream(path, self._upstream_body(), self.progress, self.lease.prefill_estimate_ms)
        body = generation.body
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            relay = self._relay(stream, include_usage)
            # Start the relay before answering: an upstream that fails at once gets an HTTP error status, and
            # the relay's clean-up (slot, settlement) is armed even if the client leaves before the body
            # starts (asyncio finalizes a started generator; one never started would hold its slot forever).
            first = await relay.__anext__()
            return RelayedStream(first, relay, headers)
        collect = asyncio.ensure_future(self._collect(stream))
        watcher = asyncio.ensure_future(watch_disconnect(request, collect))
        try:
            document = await collect
            if self.stopped is not None:
                headers["x-fairgate-stop-reason"] = self.stopped
            return JSONResponse(document, headers=headers)
        except asyncio.CancelledError:
            if watcher.done():  # the client went away: nobody is left to answer
                raise Rejection(Outcome.CLIENT_CLOSED, "client closed the request") from None
            raise
        finally:
            watcher.cancel()

    def _upstream_body(self) -> dict[str, Any]:
        """The body the upstream gets: the client's fields its kind forwards (``kinds.upstream_body``: the
        gateway's own fields such as ``user`` or ``priority`` dropped, the tenant's cache isolation set), with
        the output cap the reservation holds as ``max_tokens``."""
        generation = self.admitted.generation
        body = generation.body.model_dump(exclude_none=True)
        body["max_tokens"] = generation.max_tokens
        body.pop("max_completion_tokens", None)
        return kinds.upstream_body(self.client.kind, body, generation.chat, tenant_tag(self.admitted.caller.tenant))

    async def _rate_headers(self) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers: limits from the config, what remains from the ledger's balances
        (read beside the dispatch; omitted if that read failed or is slow)."""
        tenant, model = self.admitted.caller.tenant, self.admitted.generation.model
        try:
            limits = self.state.config.quotas.tenant(tenant).for_model_class(model)
        except KeyError:
            return {}
        account = None
        if self.admitted.balances is not None:
            try:
                account = await asyncio.wait_for(asyncio.shield(self.admitted.balances), timeout=BALANCES_WAIT_S)
            except Exception:
                account = None
        return rate_limit_headers(limits, account, self.state.wall_ms())

    async def _relay(self, stream: AsyncIterator[dict[str, Any]], include_usage: bool) -> AsyncIterator[str]:
        """The client's server-sent events; settles partially while it runs and ends the call on every path."""
        finished = sent = retrying = False
        try:
            async for chunk in stream:
                if not chunk.get("choices") and chunk.get("usage") and not include_usage:
                    continue  # the gateway asked for usage; this client did not
                if not include_usage:
                    chunk.pop("usage", None)
                yield f"data: {json.dumps(chunk)}\n\n"
                sent = self.delivered = True
                await self._checkpoint()
            finished = True
            await self._end(stream, finished, retrying)  # settled before the client reads [DONE]
            yield "data: [DONE]\n\n"
        except BudgetSpent as exc:
            finished = True
            await self._end(stream, finished, retrying)  # settled before the client reads why it stopped
            yield exc.sse_event()
        except UpstreamError as exc:
            self.progress.failed = True
            if not sent and self._another_upstream(exc):
                retrying = True
                raise TryAnotherUpstream() from None
            if not sent:  # nothing relayed yet: the client gets a plain HTTP error
                raise _upstream_failed(exc) from None
            error = {"error": {"message": str(exc), "type": "server_error", "param": None, "code": "upstream_error"}}
            yield f"data: {json.dumps(error)}\n\n"
        finally:
            await self._end(stream, finished, retrying)

    async def _collect(self, stream: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
        """Read the whole stream; the client's one response document."""
        finished = retrying = False
        try:
            async for _ in stream:
                await self._checkpoint()
            finished = True
        except BudgetSpent as exc:
            finished, self.stopped, self.progress.finish_reason = True, exc.code, "length"
        except UpstreamError as exc:
            self.progress.failed = True
            if not self.progress.output_tokens and self._another_upstream(exc):
                retrying = True
                raise TryAnotherUpstream() from None
            raise _upstream_failed(exc) from None
        finally:
            await self._end(stream, finished, retrying)
        generation = self.admitted.generation
        return completion_document(self.progress, generation.chat, generation.model, int(self.state.clock.wall_s()))

    def _another_upstream(self, exc: UpstreamError) -> bool:
        """Send the request to another upstream? Only if this one never saw it and another one is up."""
        mine = self.lease.upstream
        return (
            self.may_retry
            and exc.unreachable
            and any(u.healthy for u in self.state.dispatcher.upstreams() if u.model == mine.model and u is not mine)
        )

    async def _end(self, stream: AsyncIterator[dict[str, Any]], finished: bool, retrying: bool) -> None:
        """Close the upstream stream, free the slot, settle finally and forget the request - unless it goes
        on, under the same reservation, on another upstream. Runs to the end even if this task is cancelled
        (the client left); once."""
        if self._ended:
            return
        self._ended = True
        with anyio.CancelScope(shield=True):
            try:
                await stream.aclose()  # type: ignore[attr-defined]
                self.state.dispatcher.release(self.lease, self.progress.output_tokens)
            finally:  # whatever went wrong above, the request is settled and forgotten
                if not retrying:
                    await self._settle(final=True, cancelled=not finished)
                    self.state.calls.release(self.admitted.caller.tenant, self.admitted.generation.request_id)

    async def _checkpoint(self) -> None:
        """After each chunk: stop a request generating past its ``max_tokens``; at its first token and then
        every ``SETTLE_EVERY_TOKENS`` tokens or ``SETTLE_EVERY_S``, settle it partially (a stream), and once it
        has used the GPU time its reservation holds, stop it if its tenant's GPU budget has nothing left.
        Raises ``BudgetSpent``."""
        call, reservation = self.progress, self.admitted.reservation
        if call.output_tokens > reservation.max_output_tokens:
            raise BudgetSpent(
                "max_tokens_exceeded", f"The upstream generated past max_tokens {reservation.max_output_tokens}."
            )
        tokens, at_s = self._settled_at
        now_s = self.state.clock.monotonic_s()
        first = tokens == 0 < call.output_tokens  # the ledger learns at once that the request has run
        if not first and call.output_tokens - tokens < SETTLE_EVERY_TOKENS and now_s - at_s < SETTLE_EVERY_S:
            return
        self._settled_at = (call.output_tokens, now_s)
        if self.admitted.generation.body.stream:  # a collected call delivers nothing until it ends: not billed
            await self._settle(final=False, cancelled=False)  # before then (a platform failure refunds it all)
        if call.gpu_ms > reservation.gpu_ms_estimate and await self._gpu_left_ms() <= 0:
            raise BudgetSpent(
                "gpu_budget_exhausted",
                f"The tenant's GPU budget is spent: the request was stopped after {call.output_tokens} tokens "
                "(billed as generated).",
            )

    async def _gpu_left_ms(self) -> float:
        """GPU ms the tenant's budgets leave now (``rules.gpu_left_ms``); ``inf`` when the ledger cannot say
        (its outage policy bounds what runs meanwhile)."""
        tenant, model = self.admitted.caller.tenant, self.admitted.generation.model
        left = math.inf
        try:  # the tenant-wide budgets, and the model class's when it has its own (``TenantQuota.accounts``)
            for key, limits in self.state.config.quotas.tenant(tenant).accounts(model):
                account = rules.refreshed(await self.state.ledger.account(tenant, key), limits, self.state.wall_ms())
                left = min(left, rules.gpu_left_ms(account, limits))
        except (KeyError, LedgerError):
            return math.inf
        if not self.admitted.generation.body.stream:  # the ledger holds its estimate; the rest is not booked yet
            left -= max(0.0, self.progress.gpu_ms - self.admitted.reservation.gpu_ms_estimate)
        return left

    async def _settle(self, final: bool, cancelled: bool) -> None:
        """Book what the call used so far: the upstream's usage when it reported one, else what was relayed,
        and the metered GPU time (cumulative); ``final`` releases the rest of the reservation. A call that
        failed on the platform's side before the client received anything is not the tenant's to pay: its
        reservation is cancelled billing nothing (``_refund``)."""
        call, reservation = self.progress, self.admitted.reservation
        if final and call.failed and not self.delivered:
            await self._refund()
            return
        usage = billable_usage(call.usage) or {}
        reported_input = int(usage.get("prompt_tokens", call.prompt_tokens))
        # The ledger takes at most ``input_allowance`` of the estimate; more is billed up to it (and flagged)
        # rather than refused, which would leave the reservation open to expire billing nothing.
        input_tokens = min(reported_input, rules.input_allowance(reservation.input_tokens))
        if final and input_tokens < reported_input:
            flagged = {
                "event": "usage_above_reservation",
                "reservation": reservation.id,
                "input_tokens": reported_input,
            }
            log.warning(json.dumps({**flagged, "billed_input_tokens": input_tokens}))
        output_tokens = min(int(usage.get("completion_tokens", call.output_tokens)), reservation.max_output_tokens)
        gpu_ms = min(call.gpu_ms, GPU_MS_BILLED_MAX)
        if final:
            outcome = "cancelled" if cancelled else "completed"
            self.state.events.observe(self._finished(outcome, input_tokens, output_tokens, gpu_ms))
        try:
            if cancelled:
                await self.state.ledger.cancel(reservation.id, Usage(input_tokens, output_tokens, gpu_ms))
            else:
                await self.state.ledger.settle(reservation.id, input_tokens, output_tokens, gpu_ms, final)
        except LedgerError as exc:
            log.warning(json.dumps({"event": "settle_failed", "reservation": reservation.id, "error": str(exc)}))

    async def _refund(self) -> None:
        """Cancel the reservation of a call the upstream failed (refused, died) before the client received
        anything, billing nothing; what it used is logged (``platform_failure``), the fair policy keeps the
        GPU time it charged (the replica did spend it), and the client's 5xx is counted as a rejection."""
        call, reservation = self.progress, self.admitted.reservation
        self.state.events.observe(self._finished("error", 0, 0, 0.0))
        used = {"input_tokens": call.prompt_tokens, "output_tokens": call.output_tokens, "gpu_ms": call.gpu_ms}
        log.warning(json.dumps({"event": "platform_failure", "reservation": reservation.id, "unbilled": used}))
        try:
            await self.state.ledger.cancel(reservation.id, Usage())
        except LedgerError as exc:
            log.warning(json.dumps({"event": "settle_failed", "reservation": reservation.id, "error": str(exc)}))

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
        )


def _upstream_failed(exc: UpstreamError) -> Rejection:
    if exc.context_exceeded:  # the client's prompt, not the platform: OpenAI's context_length_exceeded
        return Rejection(Outcome.UPSTREAM_CONTEXT_EXCEEDED, str(exc))
    return Rejection(Outcome.UPSTREAM_ERROR, str(exc), status=exc.status)


def completion_document(call: CallState, chat: bool, model: str, created_s: int) -> dict[str, Any]:
    """The OpenAI response of a collected call: its text, finish reason and usage."""
    text = "".join(call.text)
    usage = call.usage or {
        "prompt_tokens": call.prompt_tokens,
        "completion_tokens": call.output_tokens,
        "total_tokens": call.prompt_tokens + call.output_tokens,
    }
    choice: dict[str, Any] = {"index": 0, "finish_reason": call.finish_reason or "stop", "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if chat else "text_completion",
        "created": created_s,
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


async def watch_disconnect(request: Request, work: asyncio.Future[Any], interval_s: float = 0.05) -> None:
    """Cancel ``work`` when the client disconnects (checked every ``interval_s``)."""
    while not work.done():
        if await request.is_disconnected():
            work.cancel()
            return
        await asyncio.sleep(interval_s)


async def _prepend(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    yield first
    async for piece in rest:
        yield piece


class RelayedStream(StreamingResponse):
    """The SSE response of a relayed stream; when the response ends - sent, failed, or its client gone at
    any point - the relay is closed, which runs its clean-up (slot, settlement) at once rather than
    whenever the garbage collector finalizes it."""

    def __init__(self, first: str, relay: AsyncIterator[str], headers: dict[str, str]) -> None:
        super().__init__(_prepend(first, relay), media_type="text/event-stream", headers=headers)
        self._relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._relay.aclose()  # type: ignore[attr-defined]
