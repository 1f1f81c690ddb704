"""Ledger throughput: reserve + final settle pairs per second, per backend, with 1 and 8 concurrent clients.

Each client is its own process with its own connection (as gateway processes are), running pairs on its
own tenant for ``--seconds``; the figure is all clients' pairs over the wall time. One run measures every
backend, so the figures compare (goals on this machine: SQLite >= 5,000/s, PostgreSQL >= 2,000/s,
Redis >= 10,000/s).

Usage: .venv/bin/python bench/ledger_ops.py [--seconds 3] [--backends sqlite,postgres,redis]
       (PostgreSQL/Redis: $FAIRGATE_TEST_POSTGRES_URL / $FAIRGATE_TEST_REDIS_URL, default 127.0.0.1.)
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import tempfile
import time
import uuid

from fairgate.harness.ledger import drop_ledger
from fairgate.ledger import connect, quotas_from_dict

QUOTAS = {
    "defaults": {
        "requests_per_minute": 1e9,
        "requests_burst": 1e9,
        "max_concurrent": 1000,
        "input_tokens_per_minute": 1e12,
        "output_tokens_per_minute": 1e12,
    },
    "tenants": {f"bench{i}": {} for i in range(8)},
}


def _client(url: str, index: int, seconds: float, start_at: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    async def run() -> int:
        ledger = await connect(url, quotas_from_dict(QUOTAS))
        tenant, done = f"bench{index}", 0
        await asyncio.sleep(max(0.0, start_at - time.time()))
        end = time.time() + seconds
        while time.time() < end:
            r = await ledger.reserve(tenant, f"{index}-{done}", 100, 50, 10.0)
            await ledger.settle(r.id, 100, 20, 8.0, final=True)
            done += 1
        await ledger.close()
        return done

    out.put(asyncio.run(run()))


def measure(url: str, clients: int, seconds: float) -> float:
    queue: mp.Queue = mp.Queue()  # type: ignore[type-arg]
    start_at = time.time() + 1.5  # every client connected before the clock starts
    processes = [mp.Process(target=_client, args=(url, i, seconds, start_at, queue)) for i in range(clients)]
    for p in processes:
        p.start()
    total: float = sum(queue.get(timeout=seconds + 60) for _ in processes)
    for p in processes:
        p.join()
    return total / seconds


def urls(backends: list[str], tmp: str) -> dict[str, str]:
    token = f"bench_{uuid.uuid4().hex[:8]}"
    pg = os.environ.get("FAIRGATE_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
    redis = os.environ.get("FAIRGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    every = {
        "sqlite": f"sqlite:///{tmp}/{token}.db",
        "postgres": f"{pg}?schema={token}",
        "redis": f"{redis}?prefix={token}",
    }
    return {name: every[name] for name in backends}


async def _prepare_and_clean(url: str, clean: bool) -> None:
    ledger = await connect(url, quotas_from_dict(QUOTAS))
    if clean:
        await drop_ledger(ledger)
    await ledger.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--backends", default="sqlite,postgres,redis")
    args = parser.parse_args()
    goals = {"sqlite": 5000, "postgres": 2000, "redis": 10000}
    with tempfile.TemporaryDirectory() as tmp:
        print(f"reserve + final settle pairs per second ({args.seconds:g} s per measurement, {os.cpu_count()} cores)")
        for name, url in urls(args.backends.split(","), tmp).items():
            asyncio.run(_prepare_and_clean(url, clean=False))
            one = measure(url, 1, args.seconds)
            eight = measure(url, 8, args.seconds)
            asyncio.run(_prepare_and_clean(url, clean=True))
            print(
                f"  {name:9s} 1 client {one:8,.0f}/s   8 clients {eight:8,.0f}/s   (x{eight / one:.2f}; "
                f"goal >= {goals[name]:,}/s)"
            )


if __name__ == "__main__":
    main()
