"""``usage(tenant, 86400)`` on a SQLite ledger with ``--events`` events in the window: the per-minute totals
it reads now against the scan of every event in the window it replaced (the same query, run in the same
transaction kind on the same file), in one run.

Usage: .venv/bin/python bench/usage_scan.py [--events 200000] [--calls 20]
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import tempfile
import time
from pathlib import Path

from fairgate.ledger import quotas_from_dict
from fairgate.ledger.model import usage_from_events
from fairgate.ledger.sql_schema import EVENT_COLUMNS, event
from fairgate.ledger.sqlite import SqliteLedger
from fairgate.ledger.usage_minutes import minute_of

QUOTAS = quotas_from_dict({"tenants": {"t": {}}})
WINDOW_S = 86_400.0


def _fill(path: Path, events: int, now_ms: float) -> None:
    """``events`` events of tenant ``t`` spread over the last day, and their minute totals, written directly."""
    step = WINDOW_S * 1000 / events
    rows = [("t", f"r{i}", "settle", 1, 10, 20, 3.5, 0.0, now_ms - (i + 1) * step) for i in range(events)]
    with sqlite3.connect(path) as db:
        db.executemany(
            "INSERT INTO fg_events (tenant, reservation_id, kind, requests, input_tokens, output_tokens, gpu_ms, "
            "overage_gpu_ms, at_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            rows,
        )
        minutes: dict[int, list[float]] = {}
        for row in rows:
            sums = minutes.setdefault(minute_of(row[8]), [0, 0, 0, 0.0, 0.0])
            for i, value in enumerate(row[3:8]):
                sums[i] += value
        db.executemany(
            "INSERT INTO fg_usage_minutes VALUES ('t', ?, ?, ?, ?, ?, ?)", [(m, *s) for m, s in minutes.items()]
        )


async def _scan(ledger: SqliteLedger) -> object:
    """The scan ``usage()`` did before the totals: every event of the window, summed in Python."""
    async with ledger._read_transaction() as tx:
        rows = await tx.fetchall(
            f"SELECT {EVENT_COLUMNS} FROM fg_events WHERE tenant = :tenant AND at_ms >= :since ORDER BY seq",
            {"tenant": "t", "since": await ledger._now_ms(tx) - WINDOW_S * 1e3},
        )
    return usage_from_events("t", WINDOW_S, [event(row) for row in rows], {})


async def _timed(call: object, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        await call()  # type: ignore[operator]
    return (time.perf_counter() - started) / calls


async def run(events: int, calls: int) -> None:
    now_ms = 1_700_000_000_000.0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ledger.db"
        ledger = SqliteLedger(path, QUOTAS, clock=lambda: now_ms, in_thread=False)
        _fill(path, events, now_ms)
        totals, scanned = await ledger.usage("t", WINDOW_S), await _scan(ledger)
        assert (totals.requests, totals.gpu_ms) == (scanned.requests, scanned.gpu_ms)  # type: ignore[attr-defined]
        new = await _timed(lambda: ledger.usage("t", WINDOW_S), calls)
        old = await _timed(lambda: _scan(ledger), max(1, calls // 10))
        await ledger.close()
    print(
        f"usage(t, 86400 s) with {events:,} events: scan {old * 1000:8.1f} ms   minute totals {new * 1000:6.2f} ms"
        f"   ratio scan/totals {old / new:,.0f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    asyncio.run(run(args.events, args.calls))


if __name__ == "__main__":
    main()
