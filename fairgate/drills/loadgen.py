"""A bounded load generator on the real ``openai`` client: streamed chat completions per tenant, with the
time to first token (TTFT) and per output token (TPOT) of every request, and errors counted by status and
code.

Each tenant's load is closed-loop (``clients`` concurrent clients, each sending its next request when the
previous one ends) or open-loop (Poisson arrivals at ``rate_per_s``), starting at ``start_s`` and bounded by
``requests_max`` and by the run's ``seconds``. Output lengths are drawn uniformly from ``output_tokens`` and
sent as ``max_tokens`` with ``ignore_eos`` (vLLM's extension, honoured by the emulator), so a request
generates exactly that many tokens.

At the deadline every client hangs up: requests still queued or streaming are cancelled (the gateway bills
what ran), and recorded as ``cut``. A request cut before its first token has waited at least as long as
it was in flight: that wait counts in the TTFT percentiles as a lower bound, so a policy that leaves a
tenant queued past the end of the run cannot look good by dropping its worst samples.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

CHAT_OVERHEAD_TOKENS = 3  # the emulator counts 3 tokens of template per chat message


@dataclass(frozen=True)
class TenantLoad:
    """One tenant's load. Exactly one of ``clients`` (closed loop) and ``rate_per_s`` (open loop) is set.

    Attributes:
        tenant / api_key: who sends (the gateway takes the tenant from the key).
        clients: closed loop: concurrent clients.
        rate_per_s: open loop: mean arrivals per second (Poisson).
        output_tokens: (min, max) output length, uniform, inclusive.
        prompt_tokens: prompt length as the emulator counts it (>= 4).
        start_s: seconds after the run starts before this tenant sends.
        ramp_s: closed loop: the clients start one after another, evenly over this many seconds from
            ``start_s`` (0: all at once).
        requests_max: at most this many requests (None: as many as fit in the run).
        in_flight_max: open loop: arrivals while this many are in flight are not sent (counted as ``skipped``).
        runs: closed loop: the clients belong to this many agent runs (client ``i`` to run ``i % runs``, every
            call of it carrying that run's ``x-fairgate-run-id``); None: no run id.
        error_backoff_s: closed loop: a client that got an error waits this long before its next request.
    """

    tenant: str
    api_key: str
    clients: int = 0
    rate_per_s: float = 0.0
    output_tokens: tuple[int, int] = (16, 16)
    prompt_tokens: int = 64
    start_s: float = 0.0
    ramp_s: float = 0.0
    requests_max: int | None = None
    in_flight_max: int = 2000
    runs: int | None = None
    error_backoff_s: float = 0.5

    def __post_init__(self) -> None:
        if (self.clients > 0) == (self.rate_per_s > 0):
            raise ValueError(f"tenant {self.tenant!r}: set either clients (closed loop) or rate_per_s (open loop)")
        low, high = self.output_tokens
        if not 1 <= low <= high:
            raise ValueError(f"tenant {self.tenant!r}: output_tokens must be (min, max) with 1 <= min <= max")
        if self.prompt_tokens < CHAT_OVERHEAD_TOKENS + 1:
            raise ValueError(f"tenant {self.tenant!r}: prompt_tokens must be >= {CHAT_OVERHEAD_TOKENS + 1}")


@dataclass(frozen=True)
class RequestSample:
    """One request as its client saw it.

    Attributes:
        sent_s: when it was sent, seconds since the run started.
        ttft_ms: time to the first content token (None: none came).
        tpot_ms: mean time per output token after the first (None: fewer than two tokens).
        waited_ms: time from sending to the end (done, error or hang-up).
        output_tokens: content tokens received.
        outcome: ``ok``, ``cut`` (still running at the deadline), or ``error``.
        error: for errors, ``<HTTP status>:<code>``, with the gateway's ``x-fairgate-quota-dimension`` in
            brackets when it names one (``429:insufficient_quota[max_model_calls]``); ``stream:<code>`` for an
            error inside the stream, ``connection`` for a transport failure.
        run_id: the agent run it belonged to, if any.
    """

    tenant: str
    sent_s: float
    ttft_ms: float | None
    tpot_ms: float | None
    waited_ms: float
    output_tokens: int
    outcome: str
    error: str | None = None
    run_id: str | None = None

    @property
    def ttft_bound_ms(self) -> float | None:
        """TTFT, or for a request cut before its first token the wait (a lower bound); None for errors."""
        if self.ttft_ms is not None:
            return self.ttft_ms
        return self.waited_ms if self.outcome == "cut" else None


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation, as numpy); None for no values."""
    return float(np.percentile(values, q)) if values else None


@dataclass(frozen=True)
class TenantStats:
    """One tenant's figures over a set of samples."""

    tenant: str
    requests: int  # sent
    completed: int
    cut: int  # still running at the deadline
    skipped: int  # open loop: not sent (in_flight_max)
    errors: dict[str, int]  # "<status>:<code>" -> count
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    output_tokens: int

    @property
    def rejected(self) -> int:
        """Requests answered 429 (rate, quota or queue full)."""
        return sum(n for code, n in self.errors.items() if code.startswith("429"))


@dataclass
class LoadReport:
    """Everything a run recorded; ``stats`` summarises one tenant over a window of send times."""

    seconds: float
    samples: list[RequestSample] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)

    def stats(self, tenant: str, sent_from_s: float = 0.0, sent_to_s: float = float("inf")) -> TenantStats:
        chosen = [s for s in self.samples if s.tenant == tenant and sent_from_s <= s.sent_s < sent_to_s]
        ttft = [v for s in chosen if (v := s.ttft_bound_ms) is not None]
        tpot = [s.tpot_ms for s in chosen if s.tpot_ms is not None]
        errors = Counter(s.error for s in chosen if s.error is not None)
        return TenantStats(
            tenant=tenant,
            requests=len(chosen),
            completed=sum(s.outcome == "ok" for s in chosen),
            cut=sum(s.outcome == "cut" for s in chosen),
            skipped=self.skipped[tenant],
            errors=dict(sorted(errors.items())),
            ttft_p50_ms=percentile(ttft, 50),
            ttft_p99_ms=percentile(ttft, 99),
            tpot_p50_ms=percentile(tpot, 50),
            output_tokens=sum(s.output_tokens for s in chosen),
        )

    def ttft_values(self, tenants: list[str], sent_from_s: float = 0.0, sent_to_s: float = float("inf")) -> list[float]:
        """TTFT (or lower bound) of every request of ``tenants`` sent in the window."""
        return [
            v
            for s in self.samples
            if s.tenant in tenants and sent_from_s <= s.sent_s < sent_to_s and (v := s.ttft_bound_ms) is not None
        ]


class _Request:
    """The client side of one streamed request, timed."""

    def __init__(self, tenant: str, sent: float, run_start: float, run_id: str | None) -> None:
        self.tenant = tenant
        self.run_id = run_id
        self.sent = sent
        self.run_start = run_start
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0

    def sample(self, outcome: str, error: str | None = None) -> RequestSample:
        end = time.perf_counter()
        ttft = None if self.first is None else (self.first - self.sent) * 1000.0
        tpot = None
        if self.first is not None and self.last is not None and self.tokens >= 2:
            tpot = (self.last - self.first) * 1000.0 / (self.tokens - 1)
        return RequestSample(
            self.tenant,
            self.sent - self.run_start,
            ttft,
            tpot,
            (end - self.sent) * 1000.0,
            self.tokens,
            outcome,
            error,
            self.run_id,
        )


def _error_key(exc: BaseException) -> str:
    import openai

    if isinstance(exc, openai.APIStatusError):
        dimension = exc.response.headers.get("x-fairgate-quota-dimension")
        return f"{exc.status_code}:{exc.code or 'unknown'}" + (f"[{dimension}]" if dimension else "")
    if isinstance(exc, openai.APIConnectionError):
        return "connection"
    if isinstance(exc, openai.APIError):  # an error event inside the stream
        return f"stream:{exc.code or 'unknown'}"
    return f"client:{type(exc).__name__}"


async def run_load(
    base_url: str, loads: list[TenantLoad], seconds: float, model: str = "emu", seed: int = 1, drain_s: float = 0.0
) -> LoadReport:
    """Send ``loads`` to the gateway at ``base_url`` for ``seconds``; then wait up to ``drain_s`` for the
    requests in flight, and hang up on the rest.

    Raises:
        ModuleNotFoundError: the ``openai`` package is not installed.
    """
    import openai

    from fairgate.gateway.intake import RUN_ID_HEADER

    if not loads:
        raise ValueError("no load to send")
    if not 0 < seconds <= 3600:
        raise ValueError(f"seconds must be in (0, 3600], got {seconds}")
    report = LoadReport(seconds)
    clients = {
        load.tenant: openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=load.api_key, max_retries=0, timeout=3600.0)
        for load in loads
    }
    active: dict[asyncio.Task[None], _Request] = {}
    sent_count: Counter[str] = Counter()
    start = time.perf_counter()
    deadline = start + seconds

    def may_send(load: TenantLoad) -> bool:
        if time.perf_counter() >= deadline:
            return False
        return load.requests_max is None or sent_count[load.tenant] < load.requests_max

    async def one(load: TenantLoad, rng: random.Random, run_id: str | None = None) -> bool:
        """One request; False if it failed."""
        tokens = rng.randint(*load.output_tokens)
        sent_count[load.tenant] += 1
        state = _Request(load.tenant, time.perf_counter(), start, run_id)
        task = asyncio.current_task()
        assert task is not None
        active[task] = state
        try:
            stream: Any = await clients[load.tenant].chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "w " * (load.prompt_tokens - CHAT_OVERHEAD_TOKENS)}],
                max_tokens=tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
                extra_headers={RUN_ID_HEADER: run_id} if run_id else None,
            )
            async with stream:  # closes the connection on every path: a hang-up reaches the gateway
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        now = time.perf_counter()
                        if state.first is None:
                            state.first = now
                        state.last = now
                        state.tokens += 1
            report.samples.append(state.sample("ok"))
            return True
        except asyncio.CancelledError:
            report.samples.append(state.sample("cut"))
            raise
        except Exception as exc:
            report.samples.append(state.sample("error", _error_key(exc)))
            return False
        finally:
            active.pop(task, None)

    async def closed_client(load: TenantLoad, index: int) -> None:
        rng = random.Random(f"{seed}-{load.tenant}-{index}")
        await asyncio.sleep(load.start_s + load.ramp_s * index / load.clients)
        run_id = None if load.runs is None else f"{load.tenant}-run-{index % load.runs}"
        while may_send(load):
            if not await one(load, rng, run_id) and load.error_backoff_s > 0:
                await asyncio.sleep(load.error_backoff_s)

    async def open_source(load: TenantLoad) -> None:
        rng = random.Random(f"{seed}-{load.tenant}-open")
        children: set[asyncio.Task[None]] = set()
        next_at = start + load.start_s
        try:
            while True:
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
                if not may_send(load):
                    break
                if sum(1 for s in active.values() if s.tenant == load.tenant) >= load.in_flight_max:
                    report.skipped[load.tenant] += 1
                else:
                    child = asyncio.create_task(one(load, rng))
                    children.add(child)
                    child.add_done_callback(children.discard)
                next_at += rng.expovariate(load.rate_per_s)
            if children:
                await asyncio.wait(children)
        finally:
            for child in children:
                child.cancel()
            if children:
                await asyncio.gather(*children, return_exceptions=True)

    # Closed-loop clients start interleaved across tenants, so no tenant's requests all arrive first.
    by_index = [
        (load, i) for i in range(max((load.clients for load in loads), default=0)) for load in loads if i < load.clients
    ]
    tasks = [asyncio.create_task(closed_client(load, i)) for load, i in by_index]
    tasks += [asyncio.create_task(open_source(load)) for load in loads if load.rate_per_s > 0]
    try:
        await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()) + drain_s)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for client in clients.values():
            await client.close()
    return report
