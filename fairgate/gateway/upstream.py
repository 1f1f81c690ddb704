"""Talking to one upstream replica: the streamed call, the live meter, and what to bill.

The gateway always asks the upstream for a stream with usage (``stream_options.include_usage``), whatever
the client asked: token arrivals drive the live meter (``fairgate.core.meter``), and a client that asked for
a plain response gets one assembled from the stream. Closing the stream (client gone, timeout) is how the
upstream is told to stop: vLLM and the emulator stop the sequence within one iteration.

A request of ``n`` choices is metered as ``n`` sequences; its choices' tokens are told apart by their
``index``. An embeddings request (``embed``) is not streamed (the API has no stream): it is metered from
the moment it is sent to its answer, its prompt weighing as prefill (the meter sees no token arrive).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from fairgate.core.meter import LiveMeter, MeterCharge, Occupancy
from fairgate.core.request import MAX_TOKENS_PER_REQUEST
from fairgate.gateway.dispatch import Upstream

# Charges to the policy, per request: (tenant, gpu_ms, output_tokens, batch size).
ChargeSink = Callable[[str, float, int, int], None]
USAGE_FIELDS = ("prompt_tokens", "completion_tokens")


class UpstreamError(Exception):
    """The upstream failed (connection, HTTP error status, malformed stream); ``status`` for the client.
    ``unreachable``: the connection was refused or timed out, so the upstream never saw the request (it may
    be sent to another one)."""

    def __init__(self, message: str, status: int = 502, unreachable: bool = False) -> None:
        super().__init__(message)
        self.status, self.unreachable = status, unreachable


@dataclass
class CallState:
    """One request's progress on its upstream: tokens seen, usage reported, GPU ms metered."""

    request_id: str
    tenant: str
    prompt_tokens: int  # the gateway's estimate until the upstream reports usage
    output_tokens: int = 0
    usage: dict[str, Any] | None = None  # as the upstream reported it (``billable_usage``: what is billed)
    finish_reason: str | None = None  # the last any choice reported (or the gateway's, when it stopped it)
    sequences: int = 1  # choices asked for (``n``)
    texts: dict[int, list[str]] = field(default_factory=dict)  # choice index -> its text pieces
    finish_reasons: dict[int, str] = field(default_factory=dict)  # choice index -> its finish reason
    first_token_s: float | None = None
    gpu_ms: float = 0.0  # metered so far
    policy_charged_ms: float = 0.0  # booked with the policy so far (starts at the prepaid prefill estimate)
    model: str = ""
    upstream: str = ""
    queue_ms: float = 0.0  # time waited in the tenant's queue before dispatch
    started_s: float = field(default_factory=time.monotonic)  # dispatch time (the clock of first_token_s)
    last_token_s: float | None = None
    failed: bool = False  # the upstream failed (as opposed to completed or cancelled by the client)


def billable_usage(usage: object) -> dict[str, int] | None:
    """The counts of an upstream's ``usage`` the gateway bills: ``prompt_tokens`` and ``completion_tokens``
    that are whole numbers in [0, ``MAX_TOKENS_PER_REQUEST``]; None when neither is. A count left out is
    billed from the gateway's own (the prompt estimate, the tokens relayed), so a replica reporting a negative,
    null or text count cannot leave a reservation unsettled (the ledger refuses such amounts)."""
    if not isinstance(usage, dict):
        return None
    counts = {
        name: value
        for name in USAGE_FIELDS
        if type(value := usage.get(name)) is int and 0 <= value <= MAX_TOKENS_PER_REQUEST
    }
    return counts or None


class UpstreamClient:
    """One upstream: its HTTP client, its live meter, and the calls in flight on it."""

    def __init__(
        self,
        upstream: Upstream,
        charge: ChargeSink,
        clock: Callable[[], float] = time.monotonic,
        timeout_s: float = 600.0,
        on_down: Callable[[Upstream], None] | None = None,
    ) -> None:
        self.upstream = upstream
        self._on_down = on_down or (lambda upstream: None)
        self._charge = charge
        self._clock = clock
        self.meter = LiveMeter(upstream.cost, clock() * 1000.0)
        self._calls: dict[str, CallState] = {}
        self.http = httpx.AsyncClient(
            base_url=upstream.url.rstrip("/"),
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=upstream.max_batch * 2 + 8),
        )

    @property
    def batch_size(self) -> int:
        """Sequences on the upstream as far as this process knows: its own and the other processes'."""
        return max(1, self.meter.sequences + round(self.meter.remote.sequences))

    def take_occupancy(self) -> Occupancy:
        """This process's occupancy of the upstream since the last call (``LiveMeter.take_occupancy``)."""
        self._book(self.meter.advance(self._now_ms()))
        return self.meter.take_occupancy()

    def set_remote(self, remote: Occupancy) -> None:
        """The other gateway processes' occupancy of the upstream, from now (``LiveMeter.set_remote``)."""
        self._book(self.meter.set_remote(remote, self._now_ms()))

    def _book(self, charges: list[MeterCharge]) -> None:
        batch = self.batch_size
        for charge in charges:
            call = self._calls.get(charge.request_id)
            if call is None:
                continue
            call.gpu_ms += charge.gpu_ms
            # The policy was charged the prefill estimate when it picked the request; book only what the
            # meter finds beyond what was booked, so the prefill is not counted twice.
            extra = call.gpu_ms - call.policy_charged_ms
            if extra > 0:
                call.policy_charged_ms += extra
                self._charge(call.tenant, extra, 0, batch)

    def _now_ms(self) -> float:
        return self._clock() * 1000.0

    async def stream(
        self, path: str, body: dict[str, Any], call: CallState, prepaid_ms: float
    ) -> AsyncIterator[dict[str, Any]]:
        """POST ``body`` (forced to stream with usage) to ``path``; yield each parsed SSE chunk.

        The meter starts when the request is sent and stops when the stream ends or the caller stops
        iterating (closing the upstream stream). Raises ``UpstreamError``.
        """
        call.policy_charged_ms = prepaid_ms
        self._calls[call.request_id] = call
        self._book(self.meter.start(call.request_id, call.tenant, call.prompt_tokens, self._now_ms(), call.sequences))
        upstream_body = dict(body, stream=True, stream_options={"include_usage": True})
        try:
            async with self.http.stream("POST", path, json=upstream_body) as response:
                if response.status_code != 200:
                    raise self._refused(response.status_code, await response.aread())
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:].strip()
                    if data == "[DONE]":
                        break
                    try:
                        chunk = json.loads(data)
                    except json.JSONDecodeError:
                        raise UpstreamError(f"upstream {self.upstream.name} sent a malformed chunk") from None
                    self._observe(call, chunk)
                    yield chunk
        except httpx.HTTPError as exc:
            raise self._failed(exc) from None
        finally:
            charges, _ = self.meter.finish(call.request_id, self._now_ms())
            self._book(charges)
            del self._calls[call.request_id]

    async def embed(self, body: dict[str, Any], call: CallState, prepaid_ms: float) -> AsyncIterator[dict[str, Any]]:
        """POST ``body`` to ``/embeddings``; yield the upstream's answer (a JSON object) once, its ``usage``
        recorded on ``call``. Metered from the send until the caller stops iterating (see module docstring);
        closing the generator early closes the connection, which tells the upstream to stop. Raises
        ``UpstreamError``."""
        call.policy_charged_ms = prepaid_ms
        self._calls[call.request_id] = call
        self._book(self.meter.start(call.request_id, call.tenant, call.prompt_tokens, self._now_ms()))
        try:
            response = await self.http.post("/embeddings", json=body)
            if response.status_code != 200:
                raise self._refused(response.status_code, response.content)
            try:
                document = response.json()
            except ValueError:
                document = None
            if not isinstance(document, dict):
                raise UpstreamError(f"upstream {self.upstream.name} sent a malformed answer")
            call.usage = document.get("usage")
            yield document
        except httpx.HTTPError as exc:
            raise self._failed(exc) from None
        finally:
            charges, _ = self.meter.finish(call.request_id, self._now_ms())
            self._book(charges)
            del self._calls[call.request_id]

    def _refused(self, status: int, detail: bytes) -> UpstreamError:
        """The error of an answer with an error status: the client's mistakes keep their status, else 502."""
        text = detail[:500].decode(errors="replace")
        return UpstreamError(
            f"upstream {self.upstream.name} answered {status}: {text}",
            status if status in (400, 413, 422, 429) else 502,
        )

    def _failed(self, exc: httpx.HTTPError) -> UpstreamError:
        unreachable = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
        if unreachable:
            self._on_down(self.upstream)  # refused or unreachable: take it out until it answers again
        return UpstreamError(f"upstream {self.upstream.name}: {type(exc).__name__}: {exc}", 502, unreachable)

    def _observe(self, call: CallState, chunk: dict[str, Any]) -> None:
        if chunk.get("usage"):
            call.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            index = choice.get("index", 0)
            index = index if type(index) is int and 0 <= index < call.sequences else 0
            delta = choice.get("delta")
            piece = (delta or {}).get("content") if delta is not None else choice.get("text")
            if piece:
                call.output_tokens += 1  # summed over the choices: the output billed
                call.texts.setdefault(index, []).append(piece)
                call.last_token_s = self._clock()
                if call.first_token_s is None:
                    call.first_token_s = self._clock()
                    self._book(self.meter.first_token(call.request_id, self._now_ms()))
                else:
                    self._book(self.meter.token(self._now_ms()))
                self._charge(call.tenant, 0.0, 1, self.batch_size)
            if choice.get("finish_reason"):
                call.finish_reason = call.finish_reasons[index] = choice["finish_reason"]

    async def close(self) -> None:
        await self.http.aclose()
