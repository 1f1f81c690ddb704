"""Upstream HTTP client: the client process's CPU per call and per token, httpx against other async clients.

The gateway's cost of relaying a stream is mostly its HTTP client's: this measures that cost alone. One
emulated replica runs as its own process (``fairgate emulate``, made fast: ``--iter-ms`` iterations, no
prefill cost), on real loopback HTTP; this process runs each client in turn on one uvloop event loop (the
gateway's) and reads its own CPU time (``time.process_time``) around each client's share of the load:
- ``httpx-pooled``: httpx set up as a gateway would (a pool, the gateway's timeouts) and used the same way:
  ``build_request`` + ``send(stream=True)``, ``aiter_lines``, the rest after ``[DONE]`` read in a task of
  its own;
- ``httpx-lean``: httpx with the leanest settings found (HTTP/1.1, no ``trust_env``, no TLS context, the
  body encoded once, ``aiter_raw`` split into lines here) and the same timeouts;
- ``httpx2``: pydantic's httpx fork (what the ``openai`` package now uses), set up as the gateway sets httpx;
- ``aiohttp``: ``ClientSession`` on a keep-alive ``TCPConnector``, the same timeouts, lines read with
  ``async for line in response.content``;
- ``aiohttp-fairgate``: the gateway's own session (``fairgate.gateway.upstream.upstream_session``) used as
  ``UpstreamClient`` uses it: lines decoded, the rest after ``[DONE]`` read in a task of its own.
Every call is an OpenAI chat completion; a streamed one (``stream: true`` with usage, as the gateway asks)
is read line by line up to ``data: [DONE]`` and its ``data:`` lines counted (each must have them all).
Workloads: streams of ``--tokens`` output tokens each (default 16 and 128), and non-streamed calls of 1
token; each with ``--calls`` calls, ``--concurrency`` at a time. After a warm-up round, ``--rounds`` rounds
run every client on every workload, the clients' order rotated each round, so that machine noise falls on
each alike. Reported per client: CPU ms per call (and each round's, for the noise) and per token, calls/s,
the emulator's CPU per call (when it is the busier process, calls/s is its rate, not the client's), and the
TCP connections the client opened (counted at the event loop's ``create_connection``): with keep-alive
about ``--concurrency`` per workload and round, not one per call (the emulator, like any uvicorn server,
closes a connection idle for 5 s, and each client idles while the others run; the gateway's way opens more,
as its call ends at ``[DONE]`` before the connection is back in the pool). Then the fixed CPU per call and
the CPU per further token (from the two shortest stream lengths), and the ratios of CPU per call.

Usage: .venv/bin/python bench/upstream_client.py [--calls 150] [--concurrency 8] [--tokens 16 128]
       [--rounds 3] [--iter-ms 0.05]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import httpx
import httpx2
import uvloop
from pydantic import SecretStr

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fairgate.gateway.dispatch import Upstream
from fairgate.gateway.upstream import DRAIN_S, upstream_session
from fairgate.harness.process import fairgate_server, free_port, running
from fairgate.harness.replica import ReplicaModel

MODEL = "emu"
KEY = "bench-key"
CONNECT_S, IDLE_S, TIMEOUT_S = 5.0, 60.0, 600.0  # the gateway's defaults (UpstreamConfig, UpstreamClient)
DONE = b"data: [DONE]"


class CountingLoop(uvloop.Loop):
    """uvloop's loop counting the TCP connections opened through it: httpx (through anyio) and aiohttp
    both connect with ``loop.create_connection``."""

    connects = 0

    async def create_connection(self, *args: Any, **kwargs: Any) -> Any:
        self.connects += 1
        return await super().create_connection(*args, **kwargs)


def connects() -> int:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, CountingLoop)
    return loop.connects


def chat_body(tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


class Client(Protocol):
    name: str

    async def stream(self, body: dict[str, Any], encoded: bytes) -> int:
        """One streamed call: its ``data:`` lines before ``[DONE]``."""
        ...

    async def plain(self, body: dict[str, Any], encoded: bytes) -> None:
        """One non-streamed call, its answer read whole."""
        ...

    async def settle(self) -> None:
        """Wait for work left in the background (reading the rest of an answer after ``[DONE]``)."""
        ...

    async def aclose(self) -> None: ...


def lines_of(chunk: bytes, rest: bytes) -> tuple[list[bytes], bytes]:
    """The complete lines of ``rest + chunk``, and what is left after the last newline."""
    lines = (rest + chunk).split(b"\n")
    return lines, lines.pop()


async def data_events(lines: AsyncIterator[str]) -> int:
    """Counts the ``data:`` events of an SSE stream before ``data: [DONE]``, which it stops at (the rest is
    drained apart, as the gateway does). Raises AssertionError: the stream ended before ``[DONE]``."""
    seen = 0
    async for line in lines:
        if line == "data: [DONE]":
            return seen
        seen += line.startswith("data: ")
    raise AssertionError("the stream ended before [DONE]")


def drain_later(drains: set[asyncio.Task[None]], drain: Coroutine[Any, Any, None]) -> None:
    """Runs ``drain`` in a task kept in ``drains`` until it ends (``settle`` waits for them all)."""
    task = asyncio.ensure_future(drain)
    drains.add(task)
    task.add_done_callback(drains.discard)


class HttpxGateway:
    """httpx used as a gateway would (``build_request`` + ``send(stream=True)``, ``aiter_lines``, the rest
    read in a task); ``lib``: httpx or a module with its API (httpx2)."""

    def __init__(self, name: str, url: str, concurrency: int, lib: Any = httpx) -> None:
        self.name = name
        self.drains: set[asyncio.Task[None]] = set()
        self.lib = lib
        config = FAST.upstream("bench", url, MODEL, max_batch=concurrency)
        upstream = Upstream(config.name, config.model, config.url, config.max_batch, config.cost)
        # A pool for max_batch * 2 + 8 connections, as the gateway's session.
        self.http: Any = lib.AsyncClient(
            base_url=upstream.url,
            headers={"authorization": f"Bearer {KEY}"},
            verify=True,
            timeout=lib.Timeout(TIMEOUT_S, connect=CONNECT_S, read=IDLE_S),
            limits=lib.Limits(max_connections=upstream.max_batch * 2 + 8, max_keepalive_connections=None),
        )

    async def stream(self, body: dict[str, Any], encoded: bytes) -> int:
        request = self.http.build_request("POST", "/chat/completions", json=body)
        response = await self.http.send(request, stream=True)
        try:
            assert response.status_code == 200, response.status_code
            lines = response.aiter_lines()
            seen = await data_events(lines)
        except BaseException:
            await response.aclose()
            raise
        drain_later(self.drains, self._drain(lines, response))
        return seen

    async def _drain(self, lines: Any, response: Any) -> None:
        try:
            async with asyncio.timeout(1.0):
                async for _ in lines:
                    pass
        except (TimeoutError, self.lib.HTTPError):
            pass
        finally:
            await response.aclose()

    async def plain(self, body: dict[str, Any], encoded: bytes) -> None:
        response = await self.http.post("/chat/completions", json=body)
        assert response.status_code == 200 and response.content, response.status_code

    async def settle(self) -> None:
        await asyncio.gather(*self.drains)

    async def aclose(self) -> None:
        await self.settle()
        await self.http.aclose()


class HttpxLean:
    """httpx with the least per-request work found: no environment, no TLS context, pool limits, the body
    encoded once, raw bytes split here (no text decoding); the gateway's timeouts kept."""

    def __init__(self, name: str, url: str, concurrency: int) -> None:
        self.name = name
        self.http = httpx.AsyncClient(
            base_url=f"{url}/v1",
            headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
            verify=False,
            trust_env=False,
            http1=True,
            http2=False,
            timeout=httpx.Timeout(TIMEOUT_S, connect=CONNECT_S, read=IDLE_S),
            limits=httpx.Limits(
                max_connections=concurrency * 2 + 8, max_keepalive_connections=None, keepalive_expiry=60.0
            ),
        )

    async def stream(self, body: dict[str, Any], encoded: bytes) -> int:
        request = self.http.build_request("POST", "/chat/completions", content=encoded)
        response = await self.http.send(request, stream=True)
        seen, done, rest = 0, False, b""
        try:
            assert response.status_code == 200, response.status_code
            async for chunk in response.aiter_raw():
                lines, rest = lines_of(chunk, rest)
                for line in lines:
                    if line.startswith(b"data: ") and not done:
                        done = line == DONE
                        seen += not done
        finally:
            await response.aclose()
        assert done, "the stream ended before [DONE]"
        return seen

    async def plain(self, body: dict[str, Any], encoded: bytes) -> None:
        request = self.http.build_request("POST", "/chat/completions", content=encoded)
        response = await self.http.send(request)
        assert response.status_code == 200 and response.content, response.status_code

    async def settle(self) -> None:
        pass

    async def aclose(self) -> None:
        await self.http.aclose()


class Aiohttp:
    """aiohttp's ``ClientSession`` on a keep-alive ``TCPConnector``, with the gateway's timeouts."""

    def __init__(self, name: str, url: str, concurrency: int) -> None:
        self.name = name
        self.url = f"{url}/v1/chat/completions"
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=concurrency * 2 + 8, keepalive_timeout=60.0),
            timeout=aiohttp.ClientTimeout(total=TIMEOUT_S, connect=CONNECT_S, sock_read=IDLE_S),
            headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
            auto_decompress=False,
        )

    async def stream(self, body: dict[str, Any], encoded: bytes) -> int:
        seen, done = 0, False
        async with self.session.post(self.url, data=encoded) as response:
            assert response.status == 200, response.status
            # Read to the end, past [DONE]: a connection is reused only once its answer is read whole.
            async for line in response.content:
                if line.startswith(b"data: ") and not done:
                    done = line.rstrip() == DONE
                    seen += not done
        assert done, "the stream ended before [DONE]"
        return seen

    async def plain(self, body: dict[str, Any], encoded: bytes) -> None:
        async with self.session.post(self.url, data=encoded) as response:
            assert response.status == 200 and await response.read(), response.status

    async def settle(self) -> None:
        pass

    async def aclose(self) -> None:
        await self.session.close()


class AiohttpGateway:
    """The gateway's own session (``upstream_session``), used as ``UpstreamClient._post`` / ``_chunks`` /
    ``_drain_later`` use it."""

    def __init__(self, name: str, url: str, concurrency: int) -> None:
        self.name = name
        self.drains: set[asyncio.Task[None]] = set()
        config = FAST.upstream("bench", url, MODEL, max_batch=concurrency)
        upstream = Upstream(config.name, config.model, config.url, config.max_batch, config.cost)
        self.url = f"{upstream.url.rstrip('/')}/chat/completions"
        self.session = upstream_session(upstream, config, SecretStr(KEY), TIMEOUT_S)

    async def stream(self, body: dict[str, Any], encoded: bytes) -> int:
        data = json.dumps(body).encode()
        response = await self.session.post(self.url, data=data, headers={"content-type": "application/json"})
        try:
            assert response.status == 200, response.status
            seen = await data_events(raw.decode(errors="replace").rstrip("\r\n") async for raw in response.content)
        except BaseException:
            response.close()
            raise
        drain_later(self.drains, self._drain(response))
        return seen

    @staticmethod
    async def _drain(response: aiohttp.ClientResponse) -> None:
        try:
            async with asyncio.timeout(DRAIN_S):
                await response.read()
            response.release()
        except (TimeoutError, aiohttp.ClientError):
            response.close()

    async def plain(self, body: dict[str, Any], encoded: bytes) -> None:
        async with self.session.post(self.url, json=body) as response:
            assert response.status == 200 and await response.read(), response.status

    async def settle(self) -> None:
        await asyncio.gather(*self.drains)

    async def aclose(self) -> None:
        await self.settle()
        await self.session.close()


# A fast replica: short iterations, no prefill cost, every call in one batch.
FAST = ReplicaModel(iter_base_ms=0.05, iter_slope_ms=0.0, prefill_ms_per_token=0.0, max_batch=4096)
CLIENTS: dict[str, Callable[[str, str, int], Client]] = {
    "httpx-pooled": lambda name, url, c: HttpxGateway(name, url, c),
    "httpx-lean": HttpxLean,
    "httpx2": lambda name, url, c: HttpxGateway(name, url, c, lib=httpx2),
    "aiohttp": Aiohttp,
    "aiohttp-fairgate": lambda name, url, c: AiohttpGateway(name, url, c),
}


@dataclass
class Tally:
    """One client's figures on one workload, summed over the measured rounds."""

    calls: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    server_cpu_s: float = 0.0
    connects: int = 0
    per_call_ms: list[float] = field(default_factory=list)  # each round's CPU per call

    def add(self, other: Tally) -> None:
        self.calls += other.calls
        self.cpu_s += other.cpu_s
        self.wall_s += other.wall_s
        self.server_cpu_s += other.server_cpu_s
        self.connects += other.connects
        self.per_call_ms += other.per_call_ms


@dataclass(frozen=True)
class Workload:
    name: str
    tokens: int  # output tokens per call
    stream: bool

    def body(self) -> dict[str, Any]:
        return chat_body(self.tokens, self.stream)


def cpu_of(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/<pid>/stat``, Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_calls(one: Callable[[], Awaitable[int | None]], calls: int, concurrency: int) -> None:
    left = [calls]

    async def worker() -> None:
        while left[0] > 0:
            left[0] -= 1
            await one()

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def segment(client: Client, work: Workload, calls: int, concurrency: int, server_pid: int) -> Tally:
    """``calls`` calls of ``work`` by ``client``: its CPU and wall time, the emulator's CPU, connections opened."""
    body = work.body()
    encoded = json.dumps(body).encode()
    expected = work.tokens + 3  # the role chunk, a chunk per token, the finish chunk, the usage chunk

    async def one() -> None:
        if work.stream:
            seen = await client.stream(body, encoded)
            assert seen == expected, f"{client.name}: {seen} data lines, {expected} expected"
        else:
            await client.plain(body, encoded)

    opened, server_before = connects(), cpu_of(server_pid)
    wall, cpu = time.perf_counter(), time.process_time()
    await run_calls(one, calls, concurrency)
    await client.settle()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    server_cpu = cpu_of(server_pid) - server_before
    return Tally(calls, cpu, wall, server_cpu, connects() - opened, [cpu * 1000.0 / calls])


async def measure(
    url: str, server_pid: int, works: Sequence[Workload], args: argparse.Namespace
) -> dict[tuple[str, str], Tally]:
    """Each client's tally per workload over the measured rounds, and (key ``("run", client)``) over the
    whole run, warm-up included."""
    clients = [make(name, url, args.concurrency) for name, make in CLIENTS.items()]
    tallies = {(w, c.name): Tally() for w in [*(w.name for w in works), "run"] for c in clients}
    try:
        for round_ in range(args.rounds + 1):  # round 0 warms up (connections, code paths) and is not counted
            calls = args.calls if round_ else max(args.concurrency, args.calls // 4)
            for work in works:
                order = clients[round_ % len(clients) :] + clients[: round_ % len(clients)]
                for client in order:
                    tally = await segment(client, work, calls, args.concurrency, server_pid)
                    tallies["run", client.name].add(tally)
                    if round_:
                        tallies[work.name, client.name].add(tally)
    finally:
        for client in clients:
            await client.aclose()
    return tallies


def report(works: Sequence[Workload], tallies: dict[tuple[str, str], Tally], args: argparse.Namespace) -> None:
    names = list(CLIENTS)
    print(
        f"{args.calls} calls x {args.rounds} rounds per client and workload, {args.concurrency} concurrent; "
        f"emulator iterations {args.iter_ms} ms; CPU: this process's (the client's), the emulator's"
    )
    head = f"{'workload':<12}{'client':<16}{'CPU ms/call':>12}{'(rounds)':>15}{'µs/token':>10}{'calls/s':>9}"
    print(head + f"{'emu ms/call':>12}{'new conns':>10}")
    for work in works:
        for name in names:
            t = tallies[work.name, name]
            per_call = t.cpu_s * 1000.0 / t.calls
            spread = f"{min(t.per_call_ms):.2f}-{max(t.per_call_ms):.2f}"
            per_token = f"{per_call * 1000.0 / work.tokens:10.1f}" if work.stream else f"{'':>10}"
            print(
                f"{work.name:<12}{name:<16}{per_call:12.3f}{spread:>15}{per_token}{t.calls / t.wall_s:9.0f}"
                f"{t.server_cpu_s * 1000.0 / t.calls:12.2f}{t.connects:10d}"
            )
    print("TCP connections opened over the whole run (warm-up included):")
    for name in names:
        t = tallies["run", name]
        print(f"  {name:<16}{t.connects:4d} for {t.calls:,} calls ({t.calls / max(1, t.connects):,.0f} calls each)")
    streams = sorted({w.tokens for w in works if w.stream})
    if len(streams) >= 2:
        short, long = (next(w for w in works if w.stream and w.tokens == n) for n in streams[:2])
        print(f"CPU split from {short.name} and {long.name}: fixed per call + per further token")
        for name in names:
            a, b = tallies[short.name, name], tallies[long.name, name]
            per_token_s = (b.cpu_s / b.calls - a.cpu_s / a.calls) / (long.tokens - short.tokens)
            fixed_s = a.cpu_s / a.calls - per_token_s * short.tokens
            print(f"  {name:<16}{fixed_s * 1000.0:7.3f} ms + {per_token_s * 1e6:5.1f} µs/token")
    print("CPU per call, ratios:")
    for work in works:
        cost = {name: tallies[work.name, name].cpu_s / tallies[work.name, name].calls for name in names}
        ratios = [f"{name}/httpx-pooled {cost[name] / cost['httpx-pooled']:.2f}" for name in names[1:]]
        ratios.append(f"aiohttp/httpx-lean {cost['aiohttp'] / cost['httpx-lean']:.2f}")
        print(f"  {work.name:<12}" + "   ".join(ratios))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=150, help="calls per client, workload and round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 128], help="output tokens of a stream")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (after one warm-up round)")
    parser.add_argument("--iter-ms", type=float, default=0.05, help="the emulator's iteration time")
    args = parser.parse_args()
    works = [Workload(f"stream {n}", n, True) for n in args.tokens] + [Workload("plain 1", 1, False)]
    model = dataclasses.replace(FAST, iter_base_ms=args.iter_ms)
    port = free_port()
    with running([fairgate_server(model.emulate_args(port, MODEL), port)]) as (emulator,):
        assert emulator.popen is not None
        with asyncio.Runner(loop_factory=CountingLoop) as runner:
            tallies = runner.run(measure(emulator.url, emulator.popen.pid, works, args))
    report(works, tallies, args)


if __name__ == "__main__":
    main()
