"""The load generator: requests to one or more gateways through the real ``openai`` client, each recorded
by request id (``fairgate.harness.records``).

- ``LoadGenerator.send(Request)``: one request, streamed or not, chat or legacy completions, with its own
  ``X-Request-Id``; options make a client misbehave the way a drill needs: hang up at a point (``Cut``:
  before any byte, after the headers, after k chunks, after a time), or let the SDK retry by itself.
- ``LoadGenerator.run(loads, seconds)``: per-tenant loads (``TenantLoad``), closed loop (clients that send
  their next request when one ends) or open loop (Poisson arrivals), bounded by ``seconds``; then a drain,
  and every client still waiting hangs up (the gateway bills what ran; the record says ``cut``).
- ``LoadGenerator.run_requests(requests)``: given requests, each at its ``at_s``, at most ``concurrency`` at
  a time.
- ``LoadGenerator.send_http(HttpRequest)``: a request the ``openai`` client cannot make (forged headers, other
  paths), as given, or byte for byte on a socket.

Output lengths are sent as ``max_tokens`` with ``ignore_eos`` (vLLM's extension, honoured by the emulator),
so a request generates exactly that many tokens.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from fairgate.harness.records import History, HttpAnswer, RequestRecord

CHAT_OVERHEAD_TOKENS = 3  # the emulator counts 3 tokens of template per chat message
DEFAULT_TARGET = "gw"
RUN_ID_HEADER = "x-fairgate-run-id"  # the gateway's agent-run header (its HTTP API)
_ANSWERS: contextvars.ContextVar[list[HttpAnswer] | None] = contextvars.ContextVar("harness_answers", default=None)


@dataclass(frozen=True)
class Cut:
    """Where a client hangs up on its own request.

    ``at``: ``headers`` (as soon as the answer's headers come, or before any byte when none came within
    ``seconds``), ``chunks`` (after ``chunks`` content chunks) or ``time`` (after ``seconds``, wherever it is).
    """

    at: Literal["headers", "chunks", "time"]
    chunks: int = 0
    seconds: float | None = None


@dataclass(frozen=True)
class Request:
    """One request to send."""

    tenant: str  # who sends it
    request_id: str  # its ``X-Request-Id``
    max_tokens: int  # its output (``ignore_eos``)
    prompt_tokens: int = 64  # the prompt as the emulator counts it (chat: >= 4, the template included)
    target: str = DEFAULT_TARGET  # the gateway's label
    model: str | None = None  # the model asked for (None: the generator's)
    stream: bool = True  # streamed (with the usage chunk) or not
    chat: bool = True  # ``/v1/chat/completions`` or ``/v1/completions``
    tag: bool = False  # the request id as the prompt's last word (an ``EmulatorTap`` finds the request by it)
    run_id: str | None = None  # its agent run (``x-fairgate-run-id``)
    cut: Cut | None = None  # where its client hangs up (None: never)
    sdk_retries: int = 0  # let the ``openai`` client retry by itself this many times (each answer recorded)
    at_s: float = 0.0  # for ``run_requests``: when to send it, seconds after the generator started

    def prompt(self) -> str:
        words = self.prompt_tokens - (CHAT_OVERHEAD_TOKENS if self.chat else 0) - int(self.tag)
        return "w " * words + (self.request_id if self.tag else "")


@dataclass(frozen=True)
class HttpRequest:
    """A request the ``openai`` client cannot make (forged headers, query strings, other paths), sent as
    given with ``httpx``, or byte for byte on a socket (``on_socket``: headers an HTTP client would refuse)."""

    tenant: str  # whom it is recorded under (the tenant it claims to be, or is expected to bill)
    request_id: str  # its ``X-Request-Id`` (already among ``headers``, if it is to be sent)
    method: str
    path: str
    headers: tuple[tuple[str, str], ...]  # as pairs: names may repeat
    params: tuple[tuple[str, str], ...] = ()
    body: dict[str, Any] | None = None
    target: str = DEFAULT_TARGET
    on_socket: bool = False


@dataclass(frozen=True)
class TenantLoad:
    """One tenant's load. Exactly one of ``clients`` (closed loop) and ``rate_per_s`` (open loop) is set."""

    tenant: str  # who sends
    target: str = DEFAULT_TARGET  # to which gateway (label)
    model: str | None = None  # asking which model (None: the generator's)
    clients: int = 0  # closed loop: concurrent clients
    rate_per_s: float = 0.0  # open loop: mean arrivals per second (Poisson)
    output_tokens: tuple[int, int] = (16, 16)  # (min, max) output length, uniform, inclusive
    # if set instead, a lognormal length of this mean (tokens, coefficient of variation 0.5)
    mean_output_tokens: float | None = None
    prompt_tokens: int = 64  # prompt length as the emulator counts it (>= 4)
    start_s: float = 0.0  # seconds after the run starts before this tenant sends
    ramp_s: float = 0.0  # closed loop: the clients start one after another, evenly over this long from ``start_s``
    in_flight_max: int = 2000  # open loop: arrivals while this many are in flight are not sent
    runs: int | None = None  # closed loop: the clients belong to this many agent runs (client i to run i % runs)
    # closed loop: after an error a client waits ``error_backoff_s * (1 + backoff_jitter * uniform(0, 1))``
    error_backoff_s: float = 0.5
    backoff_jitter: float = 0.0

    def __post_init__(self) -> None:
        if (self.clients > 0) == (self.rate_per_s > 0):
            raise ValueError(f"tenant {self.tenant!r}: set either clients (closed loop) or rate_per_s (open loop)")
        low, high = self.output_tokens
        if not 1 <= low <= high:
            raise ValueError(f"tenant {self.tenant!r}: output_tokens must be (min, max) with 1 <= min <= max")
        if self.prompt_tokens < CHAT_OVERHEAD_TOKENS + 1:
            raise ValueError(f"tenant {self.tenant!r}: prompt_tokens must be >= {CHAT_OVERHEAD_TOKENS + 1}")

    def draw_tokens(self, rng: random.Random) -> int:
        if self.mean_output_tokens is None:
            return rng.randint(*self.output_tokens)
        sigma2 = math.log1p(0.25)
        mu = math.log(self.mean_output_tokens) - sigma2 / 2
        return max(1, round(rng.lognormvariate(mu, math.sqrt(sigma2))))


class LoadGenerator:
    """Sends requests with the real ``openai`` client and records each in ``history``.

    Args:
        targets: gateway label -> base URL (or one base URL, labelled ``DEFAULT_TARGET``).
        keys: tenant -> API key. model: the model asked for by default. seed: the loads' randomness.
        timeout_s: the client's timeout per request. max_connections: per client (None: the SDK's).

    Use it as ``async with LoadGenerator(...) as gen``: the clients are closed at the end.
    """

    def __init__(
        self,
        targets: Mapping[str, str] | str,
        keys: Mapping[str, str],
        model: str = "emu",
        seed: int = 1,
        timeout_s: float = 600.0,
        max_connections: int | None = None,
    ) -> None:
        self.targets = {DEFAULT_TARGET: targets} if isinstance(targets, str) else dict(targets)
        self.keys, self.model, self.seed = dict(keys), model, seed
        self.timeout_s, self.max_connections = timeout_s, max_connections
        self.history = History()
        self.in_flight = self.peak_in_flight = 0
        self._running: Counter[str] = Counter()  # tenant -> requests in flight
        self._clients: dict[tuple[str, str, int], Any] = {}
        self._http: Any = None  # an httpx client for ``send_http``

    async def __aenter__(self) -> LoadGenerator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    def now(self) -> float:
        return self.history.now()

    def _client(self, target: str, tenant: str, retries: int) -> Any:
        import httpx
        import openai

        key = (target, tenant, retries)
        if key not in self._clients:
            options: dict[str, Any] = {"event_hooks": {"response": [_record_answer]}} if retries else {}
            if self.max_connections is not None:
                options["limits"] = httpx.Limits(max_connections=self.max_connections, max_keepalive_connections=64)
            self._clients[key] = openai.AsyncOpenAI(
                base_url=f"{self.targets[target]}/v1",
                api_key=self.keys[tenant],
                max_retries=retries,
                timeout=self.timeout_s,
                http_client=openai.DefaultAsyncHttpxClient(**options) if options else None,
            )
        return self._clients[key]

    async def send(self, request: Request) -> RequestRecord:
        """Send ``request`` and record what its client saw (the record is in ``history`` from the start).

        Raises:
            asyncio.CancelledError: the caller hung up (the record says ``cut``, ``deadline``).
        """
        import httpx
        import openai

        record = RequestRecord(
            request.request_id, request.tenant, request.target, request.max_tokens, self.now(), request.run_id
        )
        self.history.records.append(record)
        self.in_flight += 1
        self._running[request.tenant] += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        answers = _ANSWERS.set(record.answers if request.sdk_retries else None)
        try:
            if request.cut is not None and request.cut.at == "time":
                try:
                    await asyncio.wait_for(self._call(request, record), request.cut.seconds)
                except TimeoutError:
                    self._hang_up(record, "timeout")
            else:
                await self._call(request, record)
            if record.outcome == "running":
                record.outcome = "ok"
        except asyncio.CancelledError:
            if record.outcome == "running":
                self._hang_up(record, "deadline")
            raise
        except openai.APIStatusError as exc:
            record.outcome, record.status, record.code = "error", exc.status_code, exc.code
            record.dimension = exc.response.headers.get("x-fairgate-quota-dimension")
            record.retry_after = exc.response.headers.get("retry-after")
        except (openai.APIConnectionError, httpx.TransportError):
            record.outcome = "connection"
        except openai.APIError as exc:  # an error event inside the stream
            record.outcome, record.code = "stream", exc.code
        except Exception as exc:
            record.outcome, record.code = "client", type(exc).__name__
        finally:
            record.ended_s = self.now()
            self.in_flight -= 1
            self._running[request.tenant] -= 1
            _ANSWERS.reset(answers)
        return record

    async def send_http(self, request: HttpRequest) -> RequestRecord:
        """Send ``request`` as given and record its answer: status, error code, output tokens of a 200's usage;
        a transport failure is ``connection``, its message the record's ``code``."""
        import httpx

        from fairgate.harness.rawhttp import raw_request

        max_tokens = int((request.body or {}).get("max_tokens", 0))
        record = RequestRecord(request.request_id, request.tenant, request.target, max_tokens, self.now())
        self.history.records.append(record)
        url = self.targets[request.target]
        try:
            if request.on_socket:
                args = (request.method, request.path, request.headers, request.params, request.body)
                status, content = await raw_request(url, *args, timeout_s=self.timeout_s)
            else:
                if self._http is None:
                    self._http = httpx.AsyncClient(timeout=self.timeout_s)
                reply = await self._http.request(
                    request.method,
                    url + request.path,
                    headers=list(request.headers),
                    params=list(request.params),
                    json=request.body,
                )
                status, content = reply.status_code, reply.content
            _read_answer(record, status, content)
        except (httpx.HTTPError, OSError, ValueError) as exc:
            record.outcome, record.code = "connection", f"{type(exc).__name__}: {exc}"
        finally:
            record.ended_s = self.now()
        return record

    def _hang_up(self, record: RequestRecord, where: str) -> None:
        record.outcome, record.cut_at, record.hangup_s = "cut", where, self.now()

    async def _call(self, request: Request, record: RequestRecord) -> None:
        client = self._client(request.target, request.tenant, request.sdk_retries)
        headers = {"X-Request-Id": request.request_id} | ({RUN_ID_HEADER: request.run_id} if request.run_id else {})
        options: dict[str, Any] = {
            "model": request.model or self.model,
            "max_tokens": request.max_tokens,
            "stream": request.stream,
            "extra_body": {"ignore_eos": True},
            "extra_headers": headers,
        }
        if request.chat:
            options["messages"] = [{"role": "user", "content": request.prompt()}]
            if request.stream:
                options["stream_options"] = {"include_usage": True}
            create = client.chat.completions.create(**options)
        else:
            create = client.completions.create(prompt=request.prompt(), **options)
        cut = request.cut
        if cut is not None and cut.at == "headers" and cut.seconds is not None:
            try:
                result = await asyncio.wait_for(create, cut.seconds)
            except TimeoutError:
                return self._hang_up(record, "before_bytes")
        else:
            result = await create
        record.status, record.headers_s = 200, self.now()
        if not request.stream:
            record.first_s = record.last_s = record.headers_s
            if result.usage is not None:
                record.tokens, record.usage_input = result.usage.completion_tokens, result.usage.prompt_tokens
                record.usage_output = result.usage.completion_tokens
            return None
        async with result:  # closes the connection on every path: a hang-up reaches the gateway
            if cut is not None and cut.at == "headers":
                return self._hang_up(record, "after_headers")
            async for chunk in result:
                self._read(chunk, record, request.chat)
                if cut is not None and cut.at == "chunks" and record.tokens >= cut.chunks:
                    return self._hang_up(record, "after_chunks")
        return None

    def _read(self, chunk: Any, record: RequestRecord, chat: bool) -> None:
        if chunk.usage is not None:
            record.usage_input, record.usage_output = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
        if chunk.choices and (chunk.choices[0].delta.content if chat else chunk.choices[0].text):
            now = self.now()
            record.first_s = now if record.first_s is None else record.first_s
            record.last_s = now
            record.tokens += 1

    async def run(self, loads: Sequence[TenantLoad], seconds: float, drain_s: float = 0.0) -> History:
        """Send ``loads`` for ``seconds``; wait up to ``drain_s`` more for the requests in flight, then hang up
        on the rest. Returns ``history``.

        Raises:
            ValueError: no load, or ``seconds`` not in (0, 3600].
        """
        if not loads:
            raise ValueError("no load to send")
        if not 0 < seconds <= 3600:
            raise ValueError(f"seconds must be in (0, 3600], got {seconds}")
        begin = self.now()
        deadline = begin + seconds
        sent: Counter[tuple[int, str]] = Counter()

        def request(k: int, load: TenantLoad, rng: random.Random, name: str, run_id: str | None = None) -> Request:
            sent[(k, load.tenant)] += 1
            n = sent[(k, load.tenant)]
            rid = f"{load.target}-{load.tenant}-{k}-{name}-{n}"
            tokens = load.draw_tokens(rng)
            return Request(load.tenant, rid, tokens, load.prompt_tokens, load.target, load.model, run_id=run_id)

        async def closed_client(k: int, load: TenantLoad, index: int) -> None:
            rng = random.Random(f"{self.seed}-{load.target}-{load.tenant}-{k}-{index}")
            await asyncio.sleep(max(0.0, begin + load.start_s + load.ramp_s * index / load.clients - self.now()))
            run_id = None if load.runs is None else f"{load.tenant}-run-{index % load.runs}"
            while self.now() < deadline:
                record = await self.send(request(k, load, rng, str(index), run_id))
                if record.outcome != "ok" and load.error_backoff_s > 0:
                    await asyncio.sleep(load.error_backoff_s * (1 + load.backoff_jitter * rng.random()))

        async def open_source(k: int, load: TenantLoad) -> None:
            rng = random.Random(f"{self.seed}-{load.target}-{load.tenant}-{k}-open")
            children: set[asyncio.Task[RequestRecord]] = set()
            next_at = begin + load.start_s
            try:
                while True:
                    await asyncio.sleep(max(0.0, next_at - self.now()))
                    if self.now() >= deadline:
                        break
                    if self._running[load.tenant] < load.in_flight_max:
                        child = asyncio.create_task(self.send(request(k, load, rng, "o")))
                        children.add(child)
                        child.add_done_callback(children.discard)
                    next_at += rng.expovariate(load.rate_per_s)
                if children:
                    await asyncio.wait(children)
            finally:
                await _cancel(children)

        # Closed-loop clients start interleaved across tenants, so no tenant's requests all arrive first.
        indexed = list(enumerate(loads))
        order = [(k, load, i) for i in range(max(load.clients for load in loads)) for k, load in indexed]
        tasks = [asyncio.create_task(closed_client(k, load, i)) for k, load, i in order if i < load.clients]
        tasks += [asyncio.create_task(open_source(k, load)) for k, load in indexed if load.rate_per_s > 0]
        try:
            await asyncio.wait(tasks, timeout=max(0.0, deadline - self.now()) + drain_s)
        finally:
            await _cancel(tasks)
        return self.history

    async def run_requests(
        self, requests: Sequence[Request], concurrency: int | None = None, until_s: float | None = None
    ) -> list[RequestRecord]:
        """Send each of ``requests`` at its ``at_s``, at most ``concurrency`` in flight; hang up on those still
        running at ``until_s`` (seconds after the start; None: wait for every one). Returns their records,
        in the order of ``requests`` (a request hung up on before it was sent has none)."""
        gate = asyncio.Semaphore(concurrency or len(requests) or 1)

        async def one(request: Request) -> RequestRecord:
            await asyncio.sleep(max(0.0, request.at_s - self.now()))
            async with gate:
                return await self.send(request)

        tasks = [asyncio.create_task(one(r)) for r in requests]
        try:
            await asyncio.wait(tasks, timeout=None if until_s is None else max(0.0, until_s - self.now()))
        finally:
            await _cancel(tasks)
        return [t.result() for t in tasks if not t.cancelled() and t.exception() is None]


def _read_answer(record: RequestRecord, status: int, content: bytes) -> None:
    """A plain (not streamed) answer into ``record``: its status, and the error code or the usage."""
    record.status, record.outcome = status, "ok" if status == 200 else "error"
    try:
        document = json.loads(content)
    except ValueError:
        return
    if not isinstance(document, dict):
        return
    if status != 200:
        record.code = (document.get("error") or {}).get("code")
    elif isinstance(document.get("usage"), dict):
        record.usage_output = document["usage"].get("completion_tokens")
        record.usage_input = document["usage"].get("prompt_tokens")
        record.tokens = record.usage_output or 0


async def _record_answer(response: Any) -> None:
    """httpx hook: every HTTP answer of a request the SDK may retry, into its record (the hook runs in the
    task that sends it)."""
    answers = _ANSWERS.get()
    if answers is None:
        return
    code = None
    if response.status_code != 200:
        try:
            code = json.loads(await response.aread())["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = "unparsed"
    answers.append(HttpAnswer(response.status_code, code))


async def _cancel(tasks: set[asyncio.Task[Any]] | list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


__all__ = ["CHAT_OVERHEAD_TOKENS", "DEFAULT_TARGET", "Cut", "HttpRequest", "LoadGenerator", "Request", "TenantLoad"]
