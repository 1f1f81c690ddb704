"""Gateway overhead: the same load sent straight to an emulated replica and through the gateway, in one run,
for each ledger backend (``--backends``: SQLite, Redis, PostgreSQL; the servers of ``bench/ledger_ops.py``).

Per backend:
- One request at a time (``--concurrency`` 1): ``--requests`` non-streaming requests of ``--reply-tokens``
  output tokens (16): latency p50/p99 direct and through the gateway, the added latency, and the gateway
  process's CPU per request (read from ``/proc``, Linux).
- Streaming: one request of ``--tokens`` tokens: tokens/s direct and relayed by the gateway.
- The floor, one request at a time as above: ``bench/bare_relay.py`` (the gateway's HTTP stack, FastAPI on
  uvicorn with a pooled aiohttp session, relaying with nothing of fairgate's) in front of the same replica, as
  its own process: its added latency and CPU per request, and the gateway's CPU per request as a multiple of
  it. Twice: relaying the upstream's one JSON reply whole, and collecting the reply from the upstream's stream
  as a relay that meters must (the gateway asks every upstream to stream: a meter sees each token as it comes).
  Read the goals against it on a slow machine: what the stack alone costs there, the gateway's logic adds.
- The floor of streaming: the same concurrent streams as below (one round) through ``bench/bare_relay.py``, which
  relays each upstream line as it comes: its CPU per relayed token.
- Concurrent streams: ``--streams`` requests of ``--stream-tokens`` tokens at once (a batch of that size on
  the replica), ``--stream-rounds`` times: the gateway process's CPU per relayed token over all rounds (each
  round's beside it: one round of 12,800 tokens took under a second, and on a shared machine two runs of the
  same code read 0.035 and 0.049 ms), and tokens/s. That CPU includes each stream's per-request cost
  (admission, reservation, settlements): the figure less the CPU per request measured above, per stream,
  estimates the relay's own cost per token.
The replica is made fast (0.2 ms iterations, no prefill cost), so the figures are the HTTP stack's and the
gateway's (auth, ledger reserve with the run claim + settle, queue, policy, meter, relay). Emulator and gateway run as
their own processes (``fairgate emulate``, ``fairgate serve``), as in production; the load comes from this
process. The last lines set each backend's figures beside the goals: added p50 <= 1.5 ms (SQLite, Redis) or
3 ms (PostgreSQL), CPU <= 2 ms per request and <= 0.02 ms per relayed token.

Usage: .venv/bin/python bench/gateway_overhead.py [--backends sqlite,redis,postgres] [--requests 500]
       [--concurrency 1] [--reply-tokens 16] [--tokens 20000] [--streams 32] [--stream-tokens 400]
       [--stream-rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ledger_ops import urls
from fairgate.harness.config import TenantSpec
from fairgate.harness.process import ServerProcess, free_port, running
from fairgate.harness.replica import ReplicaModel
from fairgate.harness.stack import StackSpec, replicas, start_stack

# A fast replica (0.2 ms iterations, no prefill cost): what is measured is the HTTP stack's and the gateway's.
FAST = ReplicaModel(
    iter_base_ms=0.2, iter_slope_ms=0.0, prefill_ms_per_token=0.0, max_batch=1024, max_model_len=1_000_000
)
GOAL_ADDED_P50_MS = {"sqlite": 1.5, "redis": 1.5, "postgres": 3.0}
GOAL_CPU_MS_PER_REQUEST = 2.0
GOAL_CPU_MS_PER_TOKEN = 0.02


def spec(ledger_url: str) -> StackSpec:
    return StackSpec((TenantSpec("bench"),), replicas=replicas(1), replica=FAST, processes=True, ledger=ledger_url)


async def latencies(
    base: str, key: str, requests: int, concurrency: int, reply_tokens: int
) -> tuple[list[float], float]:
    body = {"model": "emu", "prompt": "x", "max_tokens": reply_tokens, "ignore_eos": True}
    out: list[float] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    async with httpx.AsyncClient(
        base_url=base,
        timeout=60,
        limits=httpx.Limits(max_connections=concurrency),
        headers={"Authorization": f"Bearer {key}"},
    ) as http:

        async def worker() -> None:
            while not queue.empty():
                queue.get_nowait()
                start = time.perf_counter()
                reply = await http.post("/v1/completions", json=body)
                assert reply.status_code == 200, reply.text
                out.append((time.perf_counter() - start) * 1000.0)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return out, requests / elapsed


async def stream_rate(base: str, key: str, tokens: int) -> float:
    body = {"model": "emu", "prompt": "x", "max_tokens": tokens, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=base, timeout=600, headers={"Authorization": f"Bearer {key}"}) as http:
        start = time.perf_counter()
        seen = 0
        async with http.stream("POST", "/v1/completions", json=body) as reply:
            async for line in reply.aiter_lines():
                seen += line.startswith('data: {"id"')
        return seen / (time.perf_counter() - start)


async def concurrent_streams(base: str, key: str, streams: int, tokens: int) -> tuple[int, float]:
    """Tokens received over ``streams`` streams of ``tokens`` sent at once, and the seconds they took."""
    body = {"model": "emu", "prompt": "x", "max_tokens": tokens, "ignore_eos": True, "stream": True}
    limits, auth = httpx.Limits(max_connections=streams), {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits, headers=auth) as http:

        async def one() -> int:
            seen = 0
            async with http.stream("POST", "/v1/completions", json=body) as reply:
                async for line in reply.aiter_lines():
                    seen += line.startswith('data: {"id"')
            return seen

        start = time.perf_counter()
        seen = await asyncio.gather(*(one() for _ in range(streams)))
        return sum(seen), time.perf_counter() - start


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/<pid>/stat``, Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1]


@dataclass
class Floor:
    """``bench/bare_relay.py``'s figures: latencies (ms) and CPU ms per request one at a time, relayed whole
    (the upstream asked for one JSON reply) and collected from the upstream's stream (as a relay that meters
    must); CPU ms per relayed token over one round of the concurrent streams."""

    plain: list[float]
    plain_cpu_ms_per_request: float
    collected: list[float]
    collected_cpu_ms_per_request: float
    cpu_ms_per_token: float


@dataclass
class Figures:
    """One backend's figures."""

    direct: list[float]
    via: list[float]
    bare: Floor  # through bench/bare_relay.py
    direct_rps: float
    via_rps: float
    cpu_ms_per_request: float
    direct_tps: float
    via_tps: float
    relayed: int
    streams_s: float
    cpu_ms_per_token: float
    round_ms_per_token: list[float]  # each round's


def measure(ledger_url: str, args: argparse.Namespace) -> Figures:
    """The figures of one stack whose gateway's ledger is at ``ledger_url``."""
    with start_stack(spec(ledger_url)) as stack:
        upstream, gateway, key = stack.replica_urls[0], stack.url, stack.keys["bench"]
        process = stack.gateways[0].process
        assert process is not None and process.popen is not None  # the gateway runs as a process
        pid = process.popen.pid
        asyncio.run(latencies(gateway, key, 20, 1, args.reply_tokens))  # warm: connections, ledger, caches
        direct, direct_rps = asyncio.run(latencies(upstream, key, args.requests, args.concurrency, args.reply_tokens))
        bare = bare_relay(upstream, key, args)
        before = cpu_s(pid)
        via, via_rps = asyncio.run(latencies(gateway, key, args.requests, args.concurrency, args.reply_tokens))
        per_request_ms = (cpu_s(pid) - before) * 1000.0 / args.requests
        direct_tps = asyncio.run(stream_rate(upstream, key, args.tokens))
        via_tps = asyncio.run(stream_rate(gateway, key, args.tokens))
        relayed, streams_s, cpu_ms, rounds = 0, 0.0, 0.0, []
        for _ in range(args.stream_rounds):
            before = cpu_s(pid)
            seen, took_s = asyncio.run(concurrent_streams(gateway, key, args.streams, args.stream_tokens))
            used_ms = (cpu_s(pid) - before) * 1000.0
            relayed, streams_s, cpu_ms = relayed + seen, streams_s + took_s, cpu_ms + used_ms
            rounds.append(used_ms / max(1, seen))
    per_token_ms = cpu_ms / max(1, relayed)
    return Figures(
        direct,
        via,
        bare,
        direct_rps,
        via_rps,
        per_request_ms,
        direct_tps,
        via_tps,
        relayed,
        streams_s,
        per_token_ms,
        rounds,
    )


def bare_relay(upstream: str, key: str, args: argparse.Namespace) -> Floor:
    """``Floor``: ``bench/bare_relay.py`` in front of ``upstream``, one request at a time on each of its two routes,
    then one round of the concurrent streams."""
    port = free_port()
    relay = ServerProcess([sys.executable, str(Path(__file__).with_name("bare_relay.py")), upstream, str(port)], port)
    with running([relay]):
        assert relay.popen is not None
        pid, out = relay.popen.pid, []
        for base in (relay.url, f"{relay.url}/collect"):
            asyncio.run(latencies(base, key, 20, 1, args.reply_tokens))  # warm: its connection upstream
            before = cpu_s(pid)
            latency_ms, _ = asyncio.run(latencies(base, key, args.requests, 1, args.reply_tokens))
            out.append((latency_ms, (cpu_s(pid) - before) * 1000.0 / args.requests))
        before = cpu_s(pid)
        seen, _ = asyncio.run(concurrent_streams(relay.url, key, args.streams, args.stream_tokens))
        token_ms = (cpu_s(pid) - before) * 1000.0 / max(1, seen)
    (plain, plain_ms), (collected, collected_ms) = out
    return Floor(plain, plain_ms, collected, collected_ms, token_ms)


def report(name: str, f: Figures, args: argparse.Namespace) -> None:
    print(f"{name}: {args.requests} requests of {args.reply_tokens} tokens, {args.concurrency} at a time:")
    print(f"  direct   p50 {pct(f.direct, 50):7.2f} ms  p99 {pct(f.direct, 99):7.2f} ms  {f.direct_rps:7.0f} req/s")
    print(f"  gateway  p50 {pct(f.via, 50):7.2f} ms  p99 {pct(f.via, 99):7.2f} ms  {f.via_rps:7.0f} req/s")
    print(
        f"  added    p50 {pct(f.via, 50) - pct(f.direct, 50):7.2f} ms  p99 {pct(f.via, 99) - pct(f.direct, 99):7.2f} ms"
        f"  gateway CPU {f.cpu_ms_per_request:.2f} ms per request"
    )
    b = f.bare
    print(
        f"  floor    bench/bare_relay.py (FastAPI + uvicorn + aiohttp, nothing of fairgate's), one at a time: relayed "
        f"whole, added p50 {pct(b.plain, 50) - pct(f.direct, 50):.2f} ms, CPU {b.plain_cpu_ms_per_request:.2f} ms per "
        f"request; collected from the upstream's stream (as a meter needs it), added p50 "
        f"{pct(b.collected, 50) - pct(f.direct, 50):.2f} ms, CPU {b.collected_cpu_ms_per_request:.2f} ms; the "
        f"gateway's CPU per request is {f.cpu_ms_per_request / b.plain_cpu_ms_per_request:.1f}x the first, "
        f"{f.cpu_ms_per_request / b.collected_cpu_ms_per_request:.1f}x the second"
    )
    print(
        f"  one stream of {args.tokens} tokens: direct {f.direct_tps:,.0f} tokens/s, through the gateway "
        f"{f.via_tps:,.0f} tokens/s (x{f.via_tps / f.direct_tps:.2f})"
    )
    print(
        f"  {args.streams} concurrent streams of {args.stream_tokens} tokens: {f.relayed:,} tokens relayed in "
        f"{f.streams_s:.1f} s ({f.relayed / f.streams_s:,.0f} tokens/s); gateway CPU "
        f"{f.cpu_ms_per_token:.3f} ms per relayed token ({1.0 / f.cpu_ms_per_token:,.0f}k tokens/s per core)"
    )
    relay_ms = f.cpu_ms_per_token - f.cpu_ms_per_request * args.streams * args.stream_rounds / max(1, f.relayed)
    print(
        f"    rounds {', '.join(f'{ms:.3f}' for ms in f.round_ms_per_token)} ms per token; less the CPU per request: "
        f"{relay_ms:.3f} ms per relayed token"
    )
    print(
        f"  floor    bench/bare_relay.py, the same streams (one round): CPU {f.bare.cpu_ms_per_token:.3f} ms per "
        f"relayed token; the gateway's is {f.cpu_ms_per_token / f.bare.cpu_ms_per_token:.1f}x it"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="sqlite,redis,postgres", help="ledger backends, comma-separated")
    parser.add_argument("--requests", type=int, default=500, help="non-streaming requests per backend")
    parser.add_argument("--concurrency", type=int, default=1, help="non-streaming requests in flight at once")
    parser.add_argument("--reply-tokens", type=int, default=16, help="output tokens of each non-streaming reply")
    parser.add_argument("--tokens", type=int, default=20000, help="output tokens of the one long stream")
    parser.add_argument("--streams", type=int, default=32, help="concurrent streams of the CPU-per-token run")
    parser.add_argument("--stream-tokens", type=int, default=400, help="output tokens of each concurrent stream")
    parser.add_argument("--stream-rounds", type=int, default=5, help="times the concurrent streams are run")
    args = parser.parse_args()
    figures: dict[str, Figures] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, url in urls(args.backends.split(","), tmp).items():
            figures[name] = measure(url, args)
            report(name, figures[name], args)
    print("against the goals (added p50 one at a time; gateway CPU per request and per relayed token):")
    for name, f in figures.items():
        added = pct(f.via, 50) - pct(f.direct, 50)
        print(
            f"  {name:9s} added p50 {added:.2f} ms (goal {GOAL_ADDED_P50_MS.get(name, 1.5):g}), "
            f"CPU {f.cpu_ms_per_request:.2f} ms per request (goal {GOAL_CPU_MS_PER_REQUEST:g}), "
            f"{f.cpu_ms_per_token:.3f} ms per token (goal {GOAL_CPU_MS_PER_TOKEN:g})"
        )


if __name__ == "__main__":
    main()
