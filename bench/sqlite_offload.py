"""SQLite ledger: reserve + final settle pairs per second with calls on the connection's thread against
calls on the event loop (``SqliteLedger(in_thread=False)``), measured in one run, alternating, so the ratio
compares like with like on a shared machine.

Also, for ``DEFAULT_BUSY_TIMEOUT_MS``: the slowest single call while ``--processes`` processes run pairs flat
out on one file (the longest any call waited for the write lock, plus its own work).

Usage: .venv/bin/python bench/sqlite_offload.py [--pairs 3000] [--rounds 3] [--processes 8]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

from fairgate.harness.ledger import bench_quotas
from fairgate.ledger import quotas_from_dict
from fairgate.ledger.sqlite import DEFAULT_BUSY_TIMEOUT_MS, SqliteLedger

QUOTAS = quotas_from_dict(bench_quotas(16))


async def _pairs(ledger: SqliteLedger, tenant: str, tag: str, n: int) -> float:
    """Run ``n`` reserve + final settle pairs; the slowest call's seconds."""
    slowest = 0.0
    for k in range(n):
        started = time.perf_counter()
        r = await ledger.reserve(tenant, f"{tag}-{k}", 100, 50, 10.0)
        middle = time.perf_counter()
        await ledger.settle(r.id, 100, 20, 8.0, final=True)
        slowest = max(slowest, middle - started, time.perf_counter() - middle)
    return slowest


async def _rate(path: Path, in_thread: bool, pairs: int, clients: int, tag: str) -> float:
    """Pairs per second of ``clients`` coroutines on one ledger connection."""
    ledger = SqliteLedger(path, QUOTAS, in_thread=in_thread)
    await _pairs(ledger, "bench0", f"warm-{tag}", 100)
    started = time.perf_counter()
    each = pairs // clients
    await asyncio.gather(*(_pairs(ledger, f"bench{i + 1}", tag, each) for i in range(clients)))
    elapsed = time.perf_counter() - started
    await ledger.close()
    return each * clients / elapsed


def _contender(path: str, index: int, seconds: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    async def run() -> float:
        ledger = SqliteLedger(path, QUOTAS)
        slowest, end, done = 0.0, time.time() + seconds, 0
        while time.time() < end:
            slowest = max(slowest, await _pairs(ledger, f"bench{index}", f"c{index}-{done}", 50))
            done += 1
        await ledger.close()
        return slowest

    out.put(asyncio.run(run()))


def _slowest_call(path: Path, processes: int, seconds: float) -> float:
    SqliteLedger(path, QUOTAS, in_thread=False)  # the tables, before the processes race to make them
    queue: mp.Queue = mp.Queue()  # type: ignore[type-arg]
    workers = [mp.Process(target=_contender, args=(str(path), i, seconds, queue)) for i in range(processes)]
    for w in workers:
        w.start()
    slowest = max(float(queue.get(timeout=seconds + 60)) for _ in workers)
    for w in workers:
        w.join()
    return slowest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3000, help="reserve + settle pairs per round and mode")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (the median is printed)")
    parser.add_argument("--processes", type=int, default=8, help="processes on one file in the lock-wait run")
    parser.add_argument("--seconds", type=float, default=3.0, help="length of the lock-wait run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(f"SQLite reserve + final settle pairs/s, median of {args.rounds} alternating rounds of {args.pairs}")
        for clients in (1, 8):
            rates: dict[bool, list[float]] = {True: [], False: []}
            for round_ in range(args.rounds):
                for in_thread in (False, True):
                    path = Path(tmp) / f"r{clients}-{round_}-{in_thread}.db"
                    rates[in_thread].append(asyncio.run(_rate(path, in_thread, args.pairs, clients, "p")))
            loop, thread = statistics.median(rates[False]), statistics.median(rates[True])
            print(
                f"  {clients} coroutine(s): on the loop {loop:7,.0f}/s   on the connection's thread "
                f"{thread:7,.0f}/s   ratio thread/loop {thread / loop:.2f}"
            )
        slowest = _slowest_call(Path(tmp) / "contended.db", args.processes, args.seconds)
        print(
            f"slowest call with {args.processes} processes on one file for {args.seconds:g} s: "
            f"{slowest * 1000:.1f} ms (busy timeout {DEFAULT_BUSY_TIMEOUT_MS} ms)"
        )


if __name__ == "__main__":
    main()
