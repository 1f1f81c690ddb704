"""Gateway overhead: the same load sent straight to an emulated replica and through the gateway, in one run.

- Non-streaming: ``--requests`` requests of 1 output token, ``--concurrency`` at a time: latency p50/p99
  and requests/s, direct and through the gateway, and the added latency.
- Streaming: one request of ``--tokens`` tokens: tokens/s direct and relayed by the gateway.
- Concurrent streams: ``--streams`` requests of ``--stream-tokens`` tokens at once (a batch of that size on
  the replica): the gateway process's CPU per relayed token, read from ``/proc`` (Linux), and tokens/s.
The replica is made fast (0.2 ms iterations, no prefill cost), so the figures are the HTTP stack's and the
gateway's (auth, ledger reserve + settle on SQLite, queue, policy, meter, relay). Emulator and gateway run
as their own processes (``fairgate emulate``, ``fairgate serve``), as in production; the load comes from
this process.
(Goals: p50 <= 1 ms and p99 <= 5 ms added at 500 req/s; relay >= 50k tokens/s per gateway process.)

Usage: .venv/bin/python bench/gateway_overhead.py [--requests 2000] [--concurrency 32] [--tokens 20000]
       [--streams 32] [--stream-tokens 400]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fairgate.harness.config import TenantSpec
from fairgate.harness.replica import ReplicaModel
from fairgate.harness.stack import StackSpec, replicas, start_stack

# A fast replica (0.2 ms iterations, no prefill cost): what is measured is the HTTP stack's and the gateway's.
FAST = ReplicaModel(
    iter_base_ms=0.2, iter_slope_ms=0.0, prefill_ms_per_token=0.0, max_batch=1024, max_model_len=1_000_000
)
SPEC = StackSpec((TenantSpec("bench"),), replicas=replicas(1), replica=FAST, processes=True)


async def latencies(base: str, key: str, requests: int, concurrency: int) -> tuple[list[float], float]:
    body = {"model": "emu", "prompt": "x", "max_tokens": 1, "ignore_eos": True}
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000, help="non-streaming requests of 1 output token")
    parser.add_argument("--concurrency", type=int, default=32, help="non-streaming requests in flight at once")
    parser.add_argument("--tokens", type=int, default=20000, help="output tokens of the one long stream")
    parser.add_argument("--streams", type=int, default=32, help="concurrent streams of the CPU-per-token run")
    parser.add_argument("--stream-tokens", type=int, default=400, help="output tokens of each concurrent stream")
    args = parser.parse_args()
    with start_stack(SPEC) as stack:
        upstream, gateway, key = stack.replica_urls[0], stack.url, stack.keys["bench"]
        direct, direct_rps = asyncio.run(latencies(upstream, key, args.requests, args.concurrency))
        via, via_rps = asyncio.run(latencies(gateway, key, args.requests, args.concurrency))
        direct_tps = asyncio.run(stream_rate(upstream, key, args.tokens))
        via_tps = asyncio.run(stream_rate(gateway, key, args.tokens))
        process = stack.gateways[0].process
        assert process is not None and process.popen is not None  # SPEC runs the gateway as a process
        before = cpu_s(process.popen.pid)
        relayed, streams_s = asyncio.run(concurrent_streams(gateway, key, args.streams, args.stream_tokens))
        gateway_cpu_s = cpu_s(process.popen.pid) - before
    print(f"non-streaming, {args.requests} requests, {args.concurrency} concurrent (1 output token each):")
    print(f"  direct   p50 {pct(direct, 50):7.2f} ms  p99 {pct(direct, 99):7.2f} ms  {direct_rps:7.0f} req/s")
    print(f"  gateway  p50 {pct(via, 50):7.2f} ms  p99 {pct(via, 99):7.2f} ms  {via_rps:7.0f} req/s")
    print(
        f"  added    p50 {pct(via, 50) - pct(direct, 50):7.2f} ms  p99 {pct(via, 99) - pct(direct, 99):7.2f} ms  "
        f"throughput x{via_rps / direct_rps:.2f}"
    )
    print(
        f"streaming, one request of {args.tokens} tokens: direct {direct_tps:,.0f} tokens/s, "
        f"through the gateway {via_tps:,.0f} tokens/s (x{via_tps / direct_tps:.2f})"
    )
    print(
        f"{args.streams} concurrent streams of {args.stream_tokens} tokens: {relayed:,} tokens relayed in "
        f"{streams_s:.1f} s ({relayed / streams_s:,.0f} tokens/s); gateway CPU {gateway_cpu_s:.2f} s, "
        f"{gateway_cpu_s * 1000.0 / max(1, relayed):.3f} ms per relayed token"
    )


if __name__ == "__main__":
    main()
