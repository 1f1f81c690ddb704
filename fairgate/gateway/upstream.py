"""Talking to one upstream replica: the streamed call, the live meter, and what to bill.

The gateway always asks the upstream for a stream with usage (``stream_options.include_usage``), whatever
the client asked: token arrivals drive the live meter (``fairgate.core.meter``), and a client that asked for
a plain response gets one assembled from the stream. Closing the stream (client gone, timeout) is how the
upstream is told to stop: vLLM and the emulator stop the sequence within one iteration.

Each chunk with generated text is a token; an engine whose chunks carry its running count of generated
tokens (llama.cpp's ``timings.predicted_n``, asked for with ``timings_per_token``: ``Kind.stream_fields``)
is counted by it, so that a token decoded to no text, which gets no chunk, is counted, bounded by
``max_tokens`` and billed like the rest (the meter sees the chunk that follows it as one arrival).

A request of ``n`` choices is metered as ``n`` sequences; its choices' tokens are told apart by their
``index``. An embeddings request (``embed``) is not streamed (the API has no stream): it is metered from
the moment it is sent to its answer, its prompt weighing as prefill (the meter sees no token arrive).
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp.http_exceptions import LineTooLong
from pydantic import SecretStr

from fairgate.core.drift import StepDrift
from fairgate.core.meter import DECODE_SCALE_RANGE, LiveMeter, MeteredCall, Occupancy
from fairgate.core.prefix_cache import cached_fraction, prefix_cache_credit
from fairgate.core.request import MAX_TOKENS_PER_REQUEST
from fairgate.gateway import sse
from fairgate.gateway.config import UpstreamConfig
from fairgate.gateway.dispatch import Upstream
from fairgate.gateway.kinds import KINDS, Kind, is_context_error
from fairgate.gateway.upstream_pool import CleanPoolConnector, read_capped, sending, stale_retry_allowed

log = logging.getLogger("fairgate.gateway")

# Charges to the policy, per request: (tenant, gpu_ms, output_tokens, batch size).
ChargeSink = Callable[[str, float, int, int], None]
# GPU ms moved between tenants in the policy's counters, summing to at most 0 (``fairgate.core.prefix_cache``).
CorrectionSink = Callable[[dict[str, float]], None]
USAGE_FIELDS = ("prompt_tokens", "completion_tokens")
# The meter's decode scale follows the drift check's ratio once it moves this much (relative): a change of scale
# brings every charge on the upstream up to date (O(in flight)), which the ratio's every step must not cost.
DECODE_SCALE_STEP = 0.02
# A request cut in a step leaves the meter when that step ends; while other requests of this process run in it,
# the step's end is their next token, waited for up to this many times the cost model's step (a model off by
# more is no longer corrected: DECODE_SCALE_RANGE). Longer, a stream not read (its client stalled) held cut
# requests on the meter for 30 s, billed 29-35x what the replica spent on them (an outside tester).
LEAVING_WAIT_STEPS = 2.0


class UpstreamError(Exception):
    """The upstream failed (connection, HTTP error status, malformed stream); ``status`` for the client.
    ``unreachable``: the connection was refused or timed out, so the upstream never saw the request (it may
    be sent to another one). ``problem``: what the upstream did wrong, one word for the log (``unreachable``,
    ``http_status``, ``request_refused``, ``auth_refused``, ``context_exceeded``, ``not_event_stream``,
    ``malformed_stream``, ``stalled``, ``connection_closed``, ``stream_unfinished``). ``sample``: some of what
    it sent, for the log only (never the client's). ``context_exceeded``: the upstream refused the prompt as
    longer than its context (the client's to fix: a 400 ``context_length_exceeded``, not a 502). ``refusal``:
    the upstream refused the request itself with a 4xx and its own OpenAI error (``request_refused``), as
    ``{"message", "type", "param", "code"}`` to relay (``UpstreamClient._status_error``)."""

    def __init__(
        self,
        message: str,
        status: int = 502,
        unreachable: bool = False,
        problem: str = "failed",
        sample: str = "",
        context_exceeded: bool = False,
        refusal: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.unreachable, self.problem, self.sample = status, unreachable, problem, sample
        self.context_exceeded, self.refusal = context_exceeded, refusal


def _refusal(error: object) -> dict[str, Any] | None:
    """An upstream's OpenAI error object (``{"error": {...}}``'s, or vLLM's older top-level one) as the fields
    to relay: its ``message``, ``type`` (``invalid_request_error`` when it gives none), ``param``, and ``code``
    when it is a string (vLLM's is the HTTP status again, a number: no reason a client can read); None when it
    is no such object (TGI's ``{"error": "..."}``, a proxy's page)."""
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return None
    kind, param, code = error.get("type"), error.get("param"), error.get("code")
    return {
        "message": error["message"][:2000],
        "type": kind if isinstance(kind, str) and kind else "invalid_request_error",
        "param": param[:200] if isinstance(param, str) else None,
        "code": code[:200] if isinstance(code, str) else None,
    }


class BudgetSpent(Exception):
    """The request is stopped: its tenant's GPU budget has nothing left (``Call``), or the upstream would
    generate past the request's ``max_tokens`` (``UpstreamClient``). ``code`` names which; the message is the
    client's."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code

    def sse_event(self) -> str:
        """The terminal server-sent event of a stream it stops (an OpenAI error object)."""
        error = {"message": str(self), "type": "insufficient_quota", "param": None, "code": self.code}
        return f"data: {json.dumps({'error': error})}\n\n"


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
    failure: UpstreamError | None = None  # how it failed (``failed``)
    generated_bytes: int = 0  # UTF-8 bytes of generated text seen (``sse.generated_bytes``)
    gpu_ms_at_last_token: float = 0.0  # ``gpu_ms`` when the last token arrived (a failed call's bill)
    # The chunk just yielded is followed at once by another that came in the same read (``UpstreamClient.stream``):
    # the relay may send them to the client together.
    more_buffered: bool = False
    unbooked_tokens: int = 0  # tokens seen but not yet booked with the policy (booked once per read)
    same_read: bool = False  # the last token was followed by another in the same read (no step between them)
    # How long the caller held the chunks yielded (before asking for the next) since the last token arrived, and
    # between that token and the one before it: a gap between two tokens is no step when the read at either end
    # of it came late (``StepDrift.observe``).
    held_ms: float = 0.0
    held_before_ms: float = 0.0
    choice_tokens: dict[int, int] = field(default_factory=dict)  # choice index -> its pieces (its max_tokens)
    reasoning: dict[int, list[str]] = field(default_factory=dict)  # choice index -> its reasoning pieces
    max_output_tokens: int | None = None  # the pieces it may generate in all (``n`` x the per-choice max_tokens)
    tool_calls: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)  # choice -> tool index -> call
    # The upstream's chunks carry its running count of generated tokens (``Kind.counts_from_timings``).
    engine_counts: bool = False
    # The part of ``gpu_ms`` a partial settlement leaves out: its prompt's prefill at the cost model's rate,
    # which a prefix-cache hit reported at the end may cut (``Kind.prefix_cache``).
    prefill_held_ms: float = 0.0
    cached_tokens: int = 0  # of its prompt, read from the engine's prefix cache (its usage)
    cache_credit_ms: float = 0.0  # GPU ms taken off its charge for them (``fairgate.core.prefix_cache``)
    # Cut in a step, it is metered until that step ends (``LiveMeter.cut``): done when it has left the meter and
    # ``gpu_ms`` is its whole charge (``UpstreamClient.stream``).
    leaving: asyncio.Future[None] | None = None


def _index(call: CallState, choice: dict[str, Any]) -> int:
    """The choice's ``index``, 0 when it is not one of the request's (an upstream's mistake is billed as 0's)."""
    index = choice.get("index", 0)
    return index if type(index) is int and 0 <= index < call.sequences else 0


def _tokens(call: CallState, chunk: dict[str, Any], choices: list[dict[str, Any]], generated: list[int]) -> list[int]:
    """The tokens each of ``choices`` (with ``generated`` bytes each) generated: one per choice with
    generated text; with the engine's running count (``CallState.engine_counts``: a request of one choice),
    also the tokens it generated that got no chunk (no text), on the chunk's first choice (a chunk without
    one, a usage chunk, gains an empty one: ``choices`` and ``generated`` are extended). Tokens the engine
    counted are never dropped, and every piece of text relayed counts at least one."""
    tokens = [1 if g else 0 for g in generated]
    timings = chunk.get("timings") if call.engine_counts else None
    so_far = timings.get("predicted_n") if isinstance(timings, dict) else None
    if type(so_far) is not int or so_far <= call.output_tokens + sum(tokens):
        return tokens
    if not choices:
        choices.append({})
        generated.append(0)
        tokens.append(0)
    tokens[0] += so_far - call.output_tokens - sum(tokens)
    return tokens


def _check_max_tokens(call: CallState, choices: list[dict[str, Any]], tokens: list[int]) -> None:
    """Stop the call before a chunk whose ``tokens`` (per choice) would take it past ``max_tokens``, in all
    or in one of its choices (OpenAI's ``max_tokens`` is per choice): that chunk is not counted, kept,
    relayed or billed, so the client receives exactly what is billed. Raises ``BudgetSpent``."""
    if call.max_output_tokens is None or not any(tokens):
        return
    per_choice = call.max_output_tokens // call.sequences
    pieces = [_index(call, choice) for choice, t in zip(choices, tokens, strict=True) for _ in range(t)]
    over = call.output_tokens + len(pieces) > call.max_output_tokens or any(
        call.choice_tokens.get(index, 0) + pieces.count(index) > per_choice for index in set(pieces)
    )
    if over:
        each = " per choice" if call.sequences > 1 else ""
        raise BudgetSpent("max_tokens_exceeded", f"The upstream generated past max_tokens {per_choice}{each}.")


def _keep(call: CallState, index: int, choice: dict[str, Any]) -> None:
    """Keep what a choice generated, for a collected answer (``completion_document``): its text (a chat
    delta's content, else a completion's text), its reasoning, and its tool calls merged by their index
    (OpenAI's streaming format: the id, type and name come once, the arguments in pieces)."""
    delta = choice.get("delta")
    source = delta if isinstance(delta, dict) else {}
    piece = source.get("content") or choice.get("text")
    if piece:
        call.texts.setdefault(index, []).append(piece)
    reasoning = source.get("reasoning_content") or source.get("reasoning")
    if reasoning:
        call.reasoning.setdefault(index, []).append(reasoning)
    calls = call.tool_calls.setdefault(index, {}) if source.get("tool_calls") else {}
    for delta_call in source.get("tool_calls") or ():
        position = delta_call.get("index", 0)
        kept = calls.setdefault(position if type(position) is int else 0, {"function": {"name": "", "arguments": ""}})
        for name in ("id", "type"):
            if isinstance(delta_call.get(name), str):
                kept[name] = delta_call[name]
        function = delta_call.get("function") or {}
        for name in ("name", "arguments"):
            kept["function"][name] += function.get(name) or ""


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


# aiohttp, not httpx, for the calls: per call it takes 0.19-0.23x httpx's CPU on 16-token streams, 0.40-0.57x
# on 128-token ones and 0.13x on plain calls (bench/upstream_client.py: httpx's pool check, h11 parsing in Python).
_DONE: dict[str, Any] = {}  # ``_parsed``'s mark for ``[DONE]`` (compared by identity)
READ_BUFSIZE = 1 << 20  # an event-stream line may be this long (aiohttp's default, 64 KiB, could cut a chunk)


def upstream_session(
    upstream: Upstream,
    settings: UpstreamConfig | None,
    api_key: SecretStr | None,
    timeout_s: float,
    pooled: bool = True,
) -> aiohttp.ClientSession:
    """The HTTP session of one upstream: its key as ``Authorization: Bearer``, its extra headers, TLS checked
    against ``ca_file`` (or the system's CAs, or not at all with ``verify_tls = false``), and its timeouts:
    ``connect_timeout_s`` to connect, ``stream_idle_timeout_s`` between two reads (so a stalled stream
    fails), ``timeout_s`` for the wait for a pooled connection. ``pooled``: keep connections open between
    requests (False: one connection per request). Call it on the event loop that will use it."""
    # Answers as sent (no gzip to inflate past what is read of them: ``upstream_pool``), unless the operator's
    # headers ask otherwise.
    headers = {"accept-encoding": "identity", **(dict(settings.headers) if settings is not None else {})}
    if api_key is not None:
        headers["authorization"] = f"Bearer {api_key.get_secret_value()}"
    verify: ssl.SSLContext | bool = True
    if settings is not None and settings.ca_file is not None:
        verify = ssl.create_default_context(cafile=settings.ca_file)
    elif settings is not None:
        verify = settings.verify_tls
    connect_s = settings.connect_timeout_s if settings is not None else 5.0
    idle_s = settings.stream_idle_timeout_s if settings is not None else timeout_s
    connector = CleanPoolConnector(limit=upstream.max_batch * 2 + 8, ssl=verify, force_close=not pooled)
    return aiohttp.ClientSession(
        connector=connector,
        headers=headers,
        auto_decompress=False,
        timeout=aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_connect=connect_s, sock_read=idle_s),
        read_bufsize=READ_BUFSIZE,
        trust_env=False,
    )


# After [DONE] an engine ends the body at once; the rest is read (so that the connection goes back to the pool:
# one with an unread body is closed) for at most this long, then the connection is dropped instead. It is read
# in a task of its own: the call ends at [DONE] (a busy emulator took tens of ms to end the body, and calls that
# waited for it held their slots that long: 55-62 requests/s against 69-70, bench/gateway_overhead.py).
DRAIN_S = 1.0
# What a GET of an engine's own endpoint reads at most (``UpstreamClient.get``): vLLM's /metrics is ~100-500 KB
# with its histograms; a probe reads only the status, and an endless body must not be read whole every second.
GET_BYTES_MAX = 8 * 1024 * 1024


async def _drain(response: aiohttp.ClientResponse) -> None:
    """Read what is left of ``response`` after its ``[DONE]`` (for at most ``DRAIN_S``, at most
    ``upstream_pool.UNRELAYED_BYTES_MAX``), then release its connection to the pool (or close it, when the rest
    did not come, or was more than that)."""
    whole = False
    try:
        _, whole = await read_capped(response, DRAIN_S)
    except (TimeoutError, aiohttp.ClientError, ValueError):  # the answer is complete; only the connection is lost
        pass
    finally:  # cancelled too (the client closing): a connection left neither released nor closed is leaked
        if whole:
            response.release()
        else:
            response.close()


class UpstreamClient:
    """One upstream: its HTTP client, its live meter, and the calls in flight on it. ``timeout_s`` bounds a
    connection's writes and pool wait; the upstream's ``stream_idle_timeout_s`` bounds the wait for each byte
    of the answer, headers included: a stall ends the call with a 504 ``UpstreamError`` (``stalled``).

    Args:
        settings: its ``[[upstream]]`` table (kind, headers, TLS, timeouts); None: a generic OpenAI server
            with default transport.
        api_key: its key (``GatewayConfig.upstream_keys``), sent as ``Authorization: Bearer``.
    """

    def __init__(
        self,
        upstream: Upstream,
        charge: ChargeSink,
        clock: Callable[[], float] = time.monotonic,
        timeout_s: float = 600.0,
        on_down: Callable[[Upstream], None] | None = None,
        settings: UpstreamConfig | None = None,
        api_key: SecretStr | None = None,
        correct: CorrectionSink | None = None,
    ) -> None:
        self.upstream = upstream
        self._correct = correct or (lambda moves: None)
        self.settings = settings  # its [[upstream]] table (None: a bare client, tests): what a reload compares
        self.kind: Kind = settings.engine if settings is not None else KINDS["openai"]
        self._on_down = on_down or (lambda upstream: None)
        self._charge = charge
        self._clock = clock
        self.idle_timeout_s = min(settings.stream_idle_timeout_s if settings is not None else 60.0, timeout_s)
        self.meter = LiveMeter(upstream.cost, clock() * 1000.0)
        self.meter.admits_after_burst = self.kind.admits_after_tokens
        self.drift = StepDrift(upstream.cost)
        self._calls: dict[str, CallState] = {}  # on the meter, by request id (those cut in a step included)
        # cut in a step -> the timer of the cost model's end of that step, and the clock by which it leaves
        self._leaving: dict[str, tuple[asyncio.TimerHandle, float]] = {}
        self._url = upstream.url.rstrip("/")
        self._session_args = (upstream, settings, api_key, timeout_s)
        self.http = upstream_session(*self._session_args)
        self._unpooled: aiohttp.ClientSession | None = None  # made when a pooled connection first fails
        self._draining: dict[aiohttp.ClientResponse, asyncio.Task[None]] = {}  # response -> the task reading its rest
        self.tokenizer_failing = False  # its engine's tokenizer failed the last count (``fairgate.gateway.tokenizer``)

    @property
    def batch_size(self) -> int:
        """Sequences on the upstream as far as this process knows: its own and the other processes'."""
        return max(1, self.meter.sequences + round(self.meter.remote.sequences))

    def take_occupancy(self) -> Occupancy:
        """This process's occupancy of the upstream since the last call (``LiveMeter.take_occupancy``); every
        call's charge is booked up to now (the calls whose first token is late included)."""
        self.meter.advance(self._now_ms())
        self._take_departed()
        for call in self._calls.values():
            self._book(call)
        return self.meter.take_occupancy()

    def set_remote(self, remote: Occupancy) -> None:
        """The other gateway processes' occupancy of the upstream, from now (``LiveMeter.set_remote``)."""
        self.meter.set_remote(remote, self._now_ms())

    def _book(self, call: CallState, gpu_ms: float | None = None, tokens: int = 0) -> None:
        """``call``'s GPU ms brought up to the meter's (or to ``gpu_ms``, its total as it left), and the
        policy charged what it was not yet (with ``tokens`` output tokens). A call is booked at its own
        tokens, not at everyone's: O(1) per token, and the policy's counters lag one iteration at most."""
        call.gpu_ms = self.meter.charged_ms(call.request_id) if gpu_ms is None else gpu_ms
        # The policy was charged the prefill estimate when it picked the request; book only what the meter
        # finds beyond what was booked, so the prefill is not counted twice.
        extra = max(0.0, call.gpu_ms - call.policy_charged_ms)
        call.policy_charged_ms += extra
        call.unbooked_tokens -= tokens
        if extra > 0 or tokens:
            self._charge(call.tenant, extra, tokens, self.batch_size)

    def _now_ms(self) -> float:
        return self._clock() * 1000.0

    async def stream(
        self, path: str, body: dict[str, Any], call: CallState, prepaid_ms: float
    ) -> AsyncGenerator[dict[str, Any], None]:
        """POST ``body`` (forced to stream with usage) to ``path``; yield each parsed SSE chunk.

        The meter starts when the request is sent and stops when the stream ends or the caller stops
        iterating (closing the upstream stream). Raises ``UpstreamError``: refused or unreachable, an error
        status, an answer that is not an event stream, a line or chunk that is not OpenAI's
        (``fairgate.gateway.sse``), no byte for ``idle_timeout_s`` (504), the connection closed, or a
        stream that ended without ``[DONE]``.
        """
        call.prefill_held_ms = self.upstream.cost.prefill_ms(call.prompt_tokens) if self.kind.prefix_cache else 0.0
        upstream_body = dict(body, stream=True, stream_options={"include_usage": True}) | dict(self.kind.stream_fields)
        call.engine_counts = self.kind.counts_from_timings and call.sequences == 1
        with self._metered(call, prepaid_ms):
            async with self._post(path, upstream_body) as response:
                await self._check_head(response)
                async for chunk, more in self._chunks(response):
                    call.more_buffered = more
                    self._observe(call, chunk)
                    yielded_s = self._clock()
                    yield chunk
                    call.held_ms += (self._clock() - yielded_s) * 1000.0

    @contextmanager
    def _metered(self, call: CallState, prepaid_ms: float) -> Iterator[None]:
        """``call`` on the meter for the block: started now (the policy prepaid ``prepaid_ms`` of it), booked
        as it leaves (``_leave``); a transport error in the block is raised as an ``UpstreamError``."""
        call.policy_charged_ms = prepaid_ms
        self._calls[call.request_id] = call
        self.meter.start(call.request_id, call.tenant, call.prompt_tokens, self._now_ms(), call.sequences)
        cut = False  # the caller stopped it (its client left, a deadline) while the upstream had it
        try:
            yield
        except aiohttp.ClientError as exc:
            raise self._transport_error(exc) from None
        except (GeneratorExit, asyncio.CancelledError):
            cut = True
            raise
        finally:
            left = (
                self.meter.cut(call.request_id, self._now_ms())
                if cut
                else self.meter.leave(call.request_id, self._now_ms())
            )
            if left is None:
                self._keep_leaving(call)
            else:
                self._leave(call, left)
                del self._calls[call.request_id]
            self._take_departed()

    def _keep_leaving(self, call: CallState) -> None:
        """``call`` was cut in the running step and stays on the meter until the step ends (``LiveMeter.cut``):
        the next burst of tokens, or the cost model's end of the step (``LiveMeter.leave_after_ms``) when no token
        of this process's can end it; its settlement waits for ``call.leaving``."""
        loop = asyncio.get_running_loop()
        call.leaving = loop.create_future()
        after_ms = self.meter.leave_after_ms(call.request_id)
        handle = loop.call_later(after_ms / 1000.0, self._depart, call.request_id)
        self._leaving[call.request_id] = (handle, self._clock() + LEAVING_WAIT_STEPS * after_ms / 1000.0)

    def _depart(self, request_id: str) -> None:
        """The cost model's end of the step ``request_id`` was cut in came: it leaves the meter, unless a request
        of this process's still runs in that step (its token will end it: the engine's step may run longer than
        the model's), up to ``LEAVING_WAIT_STEPS`` times the model's step."""
        now_ms = self._now_ms()
        self.meter.advance(now_ms)
        try:
            self._take_departed()
        finally:  # whatever booking another call raised, this one leaves or waits on
            if request_id in self._leaving:
                self._depart_or_wait(request_id, now_ms)

    def _depart_or_wait(self, request_id: str, now_ms: float) -> None:
        _, until_s = self._leaving[request_id]
        left_ms = min(self.meter.step_left_ms(), until_s * 1000.0 - now_ms)
        if self.meter.in_step(request_id) and self.meter.tokens_will_end_step and left_ms > 0:
            handle = asyncio.get_running_loop().call_later(left_ms / 1000.0, self._depart, request_id)
            self._leaving[request_id] = (handle, until_s)
            return
        self.meter.departed.append((request_id, self.meter.depart(request_id, now_ms)))
        self._take_departed()

    def _take_departed(self) -> None:
        """Book the calls cut in a step that have left the meter, and let their settlements go on (all of them,
        whatever booking one raises)."""
        if not self.meter.departed:  # asked at every call's end
            return
        departed, self.meter.departed = self.meter.departed, []
        failed: Exception | None = None
        for request_id, left in departed:
            call = self._calls.pop(request_id)
            self._leaving.pop(request_id)[0].cancel()
            try:
                self._leave(call, left)
            except Exception as exc:  # the others are booked and settled still; this one is raised after
                failed = failed or exc
            finally:
                if call.leaving is not None and not call.leaving.done():
                    call.leaving.set_result(None)
        if failed is not None:
            raise failed

    def _leave(self, call: CallState, metered: MeteredCall) -> None:
        """Book ``call``'s charge as it left, less the share of its prefill its engine's usage says it read
        from its prefix cache; the policy books that share to the tenants that ran beside it
        (``fairgate.core.prefix_cache``). Only the engine's word lowers a bill: the meter sized the prefill
        by the whole prompt, and a call that ends without usage keeps that."""
        usage = call.usage if isinstance(call.usage, dict) else {}
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) and self.kind.prefix_cache else None
        prompt_tokens = usage.get("prompt_tokens")
        fraction = cached_fraction(cached, prompt_tokens if type(prompt_tokens) is int else call.prompt_tokens)
        ratio = 1.0
        # A count far beyond the prompt the meter sized is not believed (twice it: the gateway's estimate of a
        # prompt an engine did not count runs a quarter under a real tokenizer's count of English text).
        if fraction is not None and type(cached) is int and cached <= 2 * call.prompt_tokens:
            ratio = 1.0 - fraction
            call.cached_tokens = cached
        credit_ms, moves = prefix_cache_credit(metered, ratio)
        call.cache_credit_ms = credit_ms
        self._book(call, metered.charged_ms - credit_ms, call.unbooked_tokens)
        if credit_ms:
            moves[call.tenant] = moves.get(call.tenant, 0.0) - credit_ms
            self._correct(moves)

    async def get(self, path: str, timeout_s: float, max_bytes: int = GET_BYTES_MAX) -> tuple[int, str]:
        """GET ``path`` (probes, the engine's ``/metrics``): its status and the first ``max_bytes`` of its text.
        Raises ``aiohttp.ClientError`` (``aiohttp.ConnectionTimeoutError``: no connection within half of
        ``timeout_s``) or ``TimeoutError``."""
        url = path if path.startswith(("http://", "https://")) else f"{self._url}{path}"
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=timeout_s / 2)
        async with self.http.get(url, timeout=timeout, allow_redirects=False) as response:
            body, _ = await read_capped(response, timeout_s, max_bytes)
            return response.status, body.decode(errors="replace")

    async def post_json(self, path: str, body: dict[str, Any], timeout_s: float) -> tuple[int, Any]:
        """POST ``body`` to ``path`` at the server's root (not under ``/v1``: the engines' own endpoints,
        e.g. ``/tokenize``), with the upstream's key and headers; its status and JSON answer (None when the
        answer is not JSON). Raises ``aiohttp.ClientError`` or ``TimeoutError`` (``timeout_s``, seconds,
        bounds the whole exchange)."""
        url = f"{self._url.removesuffix('/v1')}{path}"
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self.http.post(url, json=body, timeout=timeout, allow_redirects=False) as response:
            raw = await response.read()
        try:
            return response.status, json.loads(raw)
        except ValueError:
            return response.status, None

    @asynccontextmanager
    async def _post(self, path: str, body: dict[str, Any]) -> AsyncIterator[aiohttp.ClientResponse]:
        """POST ``body`` to ``path`` on a pooled connection; the response, its head read, its body unread.

        A pooled connection the upstream closed just as it was reused fails as it is written to ("Server
        disconnected without sending a response": llama-server did so to ~12 % of the connections reused right
        after a stream): that request is sent once more, on a connection of its own - only that one
        (``upstream_pool.stale_retry_allowed``: a reused connection, failed within a quarter second). A failure on
        a fresh connection, a later one, one after the head, or of that second send, is not retried (the upstream
        may have run the request). A redirect is not followed: the prompt goes to the upstream configured."""
        url, data = f"{self._url}{path}", json.dumps(body).encode()
        headers = {"content-type": "application/json"}
        sent_s = sending()
        try:
            response = await self.http.post(url, data=data, headers=headers, allow_redirects=False)
        except aiohttp.ClientConnectorError:
            raise  # never connected: nothing to retry on a fresh connection
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            if not stale_retry_allowed(sent_s):
                raise
            if self._unpooled is None:
                self._unpooled = upstream_session(*self._session_args, pooled=False)
            response = await self._unpooled.post(url, data=data, headers=headers, allow_redirects=False)
        try:
            yield response
        finally:
            if response not in self._draining:  # a drained one is released by its task
                response.close()  # an answer not read whole: closing its connection tells the upstream to stop

    async def _check_head(self, response: aiohttp.ClientResponse) -> None:
        """Raise ``UpstreamError`` unless the answer is a 200 event stream. A 4xx the client can act on keeps
        its status; an error body is quoted only when it is OpenAI's JSON (a proxy's HTML page is not)."""
        name, kind = self.upstream.name, response.headers.get("content-type", "")
        if response.status != 200:
            raise self._status_error(response, await self._error_body(response))
        if kind and not kind.lower().startswith("text/event-stream"):
            raise UpstreamError(
                f"upstream {name} answered 200 with {kind}, not an event stream", problem="not_event_stream"
            )

    async def _chunks(self, response: aiohttp.ClientResponse) -> AsyncIterator[tuple[dict[str, Any], bool]]:
        """The stream's chunks up to ``[DONE]``, each with whether another data line came in the same read (the
        relay sends those together: one write to the client instead of one per token). Raises ``UpstreamError``
        for a malformed line or chunk (the chunks before it in the same read are yielded first), a line over
        ``READ_BUFSIZE`` bytes, or a stream that ends without ``[DONE]`` (a connection closed cleanly
        mid-stream looks just like that). A body that breaks raises at once, before the bytes aiohttp still
        holds (its stream reader puts the error first): those are lost with the connection, and what the client
        did receive is what is billed."""
        rest: list[bytes] = []  # the line begun and not yet ended, in the pieces it came in
        size = 0  # their bytes
        # Only whole data lines are news: comments (a proxy's keep-alive) do not reset the idle clock, nor do the
        # pieces of a line never ended (an outside tester's upstream trickled one byte a second into a data line and
        # held the call, metered, for as long as the client waited).
        last_data_s = self._clock()
        try:
            async for data in response.content.iter_any():
                lines: list[bytes] = []
                if b"\n" not in data:  # kept in pieces, joined once the line ends: a line trickled in is O(n)
                    rest.append(data)
                    size += len(data)
                    if size > READ_BUFSIZE:
                        raise LineTooLong(data[:100], str(READ_BUFSIZE))
                else:
                    lines = (b"".join(rest) + data if rest else data).split(b"\n")
                    last = lines.pop()
                    rest, size = ([last], len(last)) if last else ([], 0)
                    if size > READ_BUFSIZE or any(len(line) > READ_BUFSIZE for line in lines):
                        raise LineTooLong(data[:100], str(READ_BUFSIZE))
                if lines and (lines[0].startswith(b"data") or any(line.startswith(b"data") for line in lines)):
                    last_data_s = self._clock()  # a data line ended in this read (most often the first)
                elif self._clock() - last_data_s > self.idle_timeout_s:
                    waited = round(self._clock() - last_data_s, 1)
                    raise UpstreamError(
                        f"upstream {self.upstream.name} sent no whole data line for {waited:g} s",
                        504,
                        problem="stalled",
                    )
                if not lines:
                    continue
                for item in self._parsed(response, lines):
                    if item[0] is _DONE:
                        return
                    yield item
            for item in self._parsed(response, [b"".join(rest)] if rest else []):  # a last line with no newline
                if item[0] is _DONE:
                    return
                yield item
        except sse.MalformedStream as exc:
            message = f"upstream {self.upstream.name} sent {exc}"
            raise UpstreamError(message, problem="malformed_stream", sample=exc.sample) from None
        except LineTooLong:
            message = f"upstream {self.upstream.name} sent a line longer than {READ_BUFSIZE} bytes"
            raise UpstreamError(message, problem="malformed_stream") from None
        raise UpstreamError(
            f"upstream {self.upstream.name} closed the stream before [DONE]", problem="stream_unfinished"
        )

    def _parsed(self, response: aiohttp.ClientResponse, lines: list[bytes]) -> Iterator[tuple[dict[str, Any], bool]]:
        """The chunks of ``lines`` (one read's whole lines), in order, each with whether a data line follows it
        among them; ``(_DONE, False)`` for ``[DONE]`` (the rest of the answer is then read in a task of its own).
        Raises ``sse.MalformedStream`` at the first line that is not server-sent events or not a chunk."""
        last_data = len(lines) - 1
        while last_data >= 0 and not lines[last_data].startswith(b"data"):
            last_data -= 1
        for i, raw in enumerate(lines):
            chunk = sse.line_chunk(raw)  # the common line, read from its bytes
            if chunk is not None:
                yield chunk, i < last_data
                continue
            data = sse.data_of(raw.decode(errors="replace").rstrip("\r"))
            if data is None:
                continue
            if data.strip() == sse.DONE:
                self._drain_later(response)
                yield _DONE, False
                return
            yield sse.chunk_of(data), i < last_data

    def _transport_error(self, exc: aiohttp.ClientError) -> UpstreamError:
        """The ``UpstreamError`` of a transport failure: refused or not connected in time (the upstream is
        taken out until it answers again; another one may be tried), stalled (504), or the connection closed
        or broken."""
        name = self.upstream.name
        if isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)):
            self._on_down(self.upstream)
            return UpstreamError(f"upstream {name}: {type(exc).__name__}: {exc}", 502, True, "unreachable")
        if isinstance(exc, aiohttp.ServerTimeoutError):
            waited = self.idle_timeout_s
            return UpstreamError(f"upstream {name} sent nothing for {waited:g} s", 504, problem="stalled")
        said = f"{type(exc).__name__}: {exc}"
        return UpstreamError(f"upstream {name} closed or broke the connection: {said}", problem="connection_closed")

    async def _error_body(self, response: aiohttp.ClientResponse) -> bytes:
        """What is quoted of an error answer: its first ``upstream_pool.UNRELAYED_BYTES_MAX`` bytes, read within
        the upstream's idle timeout (nothing, when they do not come: the error is the status)."""
        try:
            body, _ = await read_capped(response, self.idle_timeout_s)
        except (TimeoutError, aiohttp.ClientError):
            return b""
        return body

    def _status_error(self, response: aiohttp.ClientResponse, body: bytes) -> UpstreamError:
        """The ``UpstreamError`` of an answer with an error status: a refused credential is the operator's
        (502, ``auth_refused``, its body left out: a server may echo the key it refused); a prompt over the
        engine's context is the client's (400, ``context_exceeded``: ``kinds.is_context_error``); another 4xx
        the client can act on keeps its status, the rest are 502. The body is quoted only when it is OpenAI's
        JSON (a proxy's HTML page is not); a 400, 413 or 422 with OpenAI's error object (``_refusal``) is the
        client's error (``request_refused``), relayed as the engine said it."""
        name, kind, status = self.upstream.name, response.headers.get("content-type", ""), response.status
        detail = body[:2000].decode(errors="replace")
        if status in (401, 403):
            return UpstreamError(
                f"upstream {name} refused the gateway's credentials ({status}): the gateway's configuration of "
                "that upstream is wrong (api_key_env / api_key_file); the request was not run and is not billed",
                problem="auth_refused",
            )
        if is_context_error(self.kind, status, detail):
            message = f"upstream {name}: the prompt does not fit the model's context: {detail[:500]}"
            return UpstreamError(message, 400, problem="context_exceeded", context_exceeded=True)
        try:
            document = json.loads(detail)
            error = document.get("error", document) if isinstance(document, dict) else document
            said = f": {(error.get('message') if isinstance(error, dict) else None) or detail[:500]}"
        except json.JSONDecodeError:
            error, said = None, f" with {kind or 'no content type'}, not an OpenAI error"
        relayed = status if status in (400, 413, 422, 429) else 502
        message = f"upstream {name} answered {status}{said}"
        # A 429 is the upstream's load (or the operator's account with a provider), not the client's request.
        refusal = _refusal(error) if status in (400, 413, 422) else None
        problem = "http_status" if refusal is None else "request_refused"
        return UpstreamError(message, relayed, problem=problem, sample=detail[: sse.SAMPLE_CHARS], refusal=refusal)

    async def embed(
        self, body: dict[str, Any], call: CallState, prepaid_ms: float
    ) -> AsyncGenerator[dict[str, Any], None]:
        """POST ``body`` to ``/embeddings``; yield the upstream's answer (a JSON object) once, its ``usage``
        recorded on ``call``. Metered from the send until the caller stops iterating (see module docstring);
        closing the generator early closes the connection, which tells the upstream to stop. Raises
        ``UpstreamError``."""
        with self._metered(call, prepaid_ms):
            async with self.http.post(f"{self._url}/embeddings", json=body, allow_redirects=False) as response:
                if response.status != 200:
                    raise self._status_error(response, await self._error_body(response))
                answer = await response.read()
            try:
                document = json.loads(answer)
            except ValueError:
                document = None
            if not isinstance(document, dict):
                raise UpstreamError(
                    f"upstream {self.upstream.name} sent a malformed answer", problem="malformed_answer"
                )
            call.usage = document.get("usage")
            yield document

    def _observe(self, call: CallState, chunk: dict[str, Any]) -> None:
        """Count, meter and keep what ``chunk`` generated. Raises ``UpstreamError``: more choice entries in one
        chunk than the request's ``n`` (each is a piece: more would let one chunk run far past ``max_tokens``)."""
        if chunk.get("usage"):
            call.usage = chunk["usage"]
        choices = chunk.get("choices") or []
        if len(choices) > call.sequences:
            raise UpstreamError(
                f"upstream {self.upstream.name} sent a chunk of {len(choices)} choices for {call.sequences} asked",
                problem="malformed_stream",
            )
        piece = sse.plain_text(choices[0]) if len(choices) == 1 == call.sequences and not call.engine_counts else None
        if piece is not None:
            self._observe_plain(call, choices[0], piece)
        else:
            self._observe_choices(call, chunk, list(choices))  # a copy: ``_tokens`` may add one
        if call.unbooked_tokens and not call.more_buffered:
            # With the policy once per upstream read, not per token (the chunks of one read arrived at one
            # instant): one booking and one round of observers for all of them.
            self._book(call, tokens=call.unbooked_tokens)

    def _observe_plain(self, call: CallState, choice: dict[str, Any], piece: str) -> None:
        """``_observe``'s bookkeeping for the common chunk: one choice of a one-choice request carrying plain
        text only (``sse.plain_text``), whose count is its text (no engine count). The same as
        ``_observe_choices`` with fewer calls and no lists (py-spy, 32 streams on a fast replica: ``_observe``
        went from 27 % of the event loop's samples to 14 %)."""
        generated = len(piece) if piece.isascii() else len(piece.encode("utf-8"))
        if generated:
            # One choice: its pieces are the call's (``choice_tokens[0] == output_tokens``).
            if call.max_output_tokens is not None and call.output_tokens >= call.max_output_tokens:
                raise BudgetSpent(
                    "max_tokens_exceeded", f"The upstream generated past max_tokens {call.max_output_tokens}."
                )
            call.generated_bytes += generated
            call.texts.setdefault(0, []).append(piece)
            self._arrived(call, 0, 1)
        if choice.get("finish_reason"):
            call.finish_reason = call.finish_reasons[0] = choice["finish_reason"]

    def _observe_choices(self, call: CallState, chunk: dict[str, Any], choices: list[dict[str, Any]]) -> None:
        """``_observe``'s bookkeeping for any chunk: each choice's generated bytes and tokens (``_tokens``), checked
        against ``max_tokens``, kept, counted and metered."""
        generated_by_choice = [sse.generated_bytes(choice) for choice in choices]
        tokens_by_choice = _tokens(call, chunk, choices, generated_by_choice)
        _check_max_tokens(call, choices, tokens_by_choice)
        for choice, generated, tokens in zip(choices, generated_by_choice, tokens_by_choice, strict=True):
            call.generated_bytes += generated
            index = _index(call, choice)
            _keep(call, index, choice)
            # Any generated text is a piece, counted against max_tokens and billed: content, and reasoning, a
            # refusal or tool-call arguments, which an engine streams in deltas of their own; and the tokens
            # the engine's running count says it generated without a chunk (``_tokens``).
            if tokens:
                self._arrived(call, index, tokens)
            if choice.get("finish_reason"):
                call.finish_reason = call.finish_reasons[index] = choice["finish_reason"]

    def _arrived(self, call: CallState, index: int, tokens: int) -> None:
        """``tokens`` of choice ``index`` arrived now: counted (summed over the choices: the output billed),
        fed to the drift check and the meter, and left to book (``_observe``)."""
        call.output_tokens += tokens
        call.choice_tokens[index] = call.choice_tokens.get(index, 0) + tokens
        now_s = self._clock()
        self._step(call, now_s, tokens)
        call.held_before_ms, call.held_ms = call.held_ms, 0.0
        call.last_token_s = now_s
        if call.first_token_s is None:
            call.first_token_s = now_s
            self.meter.first_token(call.request_id, now_s * 1000.0)
        else:
            self.meter.token(now_s * 1000.0)
        if self.meter.departed:
            self._take_departed()
        call.unbooked_tokens += tokens
        call.gpu_ms_at_last_token = self.meter.charged_ms(call.request_id)
        call.same_read = call.more_buffered  # the next token, if it is of this read, is no step

    def _step(self, call: CallState, now_s: float, tokens: int = 1) -> None:
        """Feed the drift check one observed step: the gap since this call's previous token, while every
        request in flight here decodes (a prefill lengthens its iteration; a call of several choices gets
        several tokens an iteration; two tokens of one read are microseconds apart, which is no step; a chunk
        of ``tokens`` > 1 ends several steps, the ones before it unseen); the meter's decode step follows its
        ratio (``LiveMeter.set_decode_scale``)."""
        if call.last_token_s is None or call.sequences != 1 or self.meter.prefilling or call.same_read or tokens > 1:
            return
        gap_ms = (now_s - call.last_token_s) * 1000.0
        batch = self.meter.sequences + round(self.meter.remote.sequences)
        crossed = self.drift.observe(gap_ms, batch, max(call.held_ms, call.held_before_ms))
        ratio, scale = self.drift.ratio, self.meter.decode_scale
        if ratio is not None and abs(ratio - scale) > DECODE_SCALE_STEP * scale:
            low, high = DECODE_SCALE_RANGE
            # A ratio beyond the range leaves the scale at its bound: no call (the token's own advance follows).
            if (bounded := min(high, max(low, ratio))) != scale:
                self.meter.set_decode_scale(bounded, now_s * 1000.0)
        if crossed is not None:
            line: dict[str, Any] = {"event": "cost_model_drift" if crossed else "cost_model_drift_ended"}
            line |= {"upstream": self.upstream.name, "observed_over_predicted": round(self.drift.ratio or 0.0, 3)}
            (log.warning if crossed else log.info)(json.dumps(line))

    def _drain_later(self, response: aiohttp.ClientResponse) -> None:
        self._draining[response] = asyncio.ensure_future(_drain(response))
        self._draining[response].add_done_callback(lambda _: self._draining.pop(response, None))

    async def close(self) -> None:
        now_ms = self._now_ms()  # the calls cut in a step leave now, and their settlements go on
        self.meter.advance(now_ms)
        self._take_departed()
        self.meter.departed += [(request_id, self.meter.depart(request_id, now_ms)) for request_id in self._leaving]
        self._take_departed()
        for task in list(self._draining.values()):
            task.cancel()
        await asyncio.gather(*self._draining.values(), return_exceptions=True)
        await self.http.close()
        if self._unpooled is not None:
            await self._unpooled.close()
