"""Issue 12, item 6: another process holding the SQLite ledger's write lock stalls neither the event loop
nor a caller past the busy timeout: ledger calls run on the connection's thread, and a call that cannot get
the lock in ``busy_timeout_ms`` (default 2 s) raises ``LedgerUnavailable``, so the tier's outage policy
applies. The lock is held by a real second process (``BEGIN EXCLUSIVE``)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from fairgate.ledger import LedgerUnavailable, check_url, connect, quotas_from_dict
from fairgate.ledger.sqlite import DEFAULT_BUSY_TIMEOUT_MS, parse_url

QUOTAS = quotas_from_dict({"tenants": {"a": {}}})
_HOLD = (
    "import sqlite3, sys, time\n"
    "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
    "c.execute('BEGIN EXCLUSIVE')\n"
    "print('locked', flush=True)\n"
    "time.sleep(float(sys.argv[2]))\n"
    "c.execute('COMMIT')\n"
)


@contextmanager
def locked(path: Path, seconds: float) -> Iterator[subprocess.Popen[str]]:
    """Another process holding ``BEGIN EXCLUSIVE`` on ``path`` for ``seconds`` (or until the block ends)."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(path), str(seconds)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        yield holder
    finally:
        holder.kill()
        holder.wait()
        assert holder.stdout is not None
        holder.stdout.close()


class Ticker:
    """Ticks every 5 ms on the event loop; ``max_gap_s``: the longest the loop kept it waiting."""

    def __init__(self) -> None:
        self.max_gap_s = 0.0
        self.ticks = 0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            self.max_gap_s, last = max(self.max_gap_s, now - last), now
            self.ticks += 1

    def __enter__(self) -> Ticker:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


async def test_a_locked_ledger_fails_a_reserve_within_the_default_bound_and_the_loop_keeps_running(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.db"
    async with await connect(f"sqlite:///{path}", QUOTAS) as ledger:
        await ledger.reserve("a", "before", 1, 1)
        with locked(path, 5.0):
            with Ticker() as ticker:
                started = time.perf_counter()
                with pytest.raises(LedgerUnavailable, match="database is locked"):
                    await ledger.reserve("a", "during", 1, 1)
                waited = time.perf_counter() - started
            assert DEFAULT_BUSY_TIMEOUT_MS / 1000 * 0.9 <= waited < DEFAULT_BUSY_TIMEOUT_MS / 1000 + 0.5
            assert ticker.max_gap_s < 0.1 and ticker.ticks >= 50  # the loop ran all along
        assert (await ledger.reserve("a", "after", 1, 1)).status == "open"  # the lock gone, the ledger answers
        assert [r.request_id for r in await ledger.reservations()] == ["before", "after"]


async def test_calls_queued_behind_a_locked_ledger_share_one_bound(tmp_path: Path) -> None:
    # Eight calls at once on one connection: each fails within busy_timeout_ms of being made, not eight
    # busy timeouts after the first (they queue for the connection's thread).
    path = tmp_path / "ledger.db"
    async with await connect(f"sqlite:///{path}?busy_timeout_ms=300", QUOTAS) as ledger:
        await ledger.reserve("a", "before", 1, 1)
        with locked(path, 5.0), Ticker() as ticker:
            started = time.perf_counter()
            results = await asyncio.gather(
                *(ledger.reserve("a", f"r{i}", 1, 1) for i in range(8)), return_exceptions=True
            )
            waited = time.perf_counter() - started
        assert [type(r) for r in results] == [LedgerUnavailable] * 8
        assert waited < 0.3 + 0.4 and ticker.max_gap_s < 0.1
        assert len(await ledger.reservations()) == 1


async def test_a_call_cancelled_while_it_waits_for_the_lock_leaves_no_transaction_open(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    async with await connect(f"sqlite:///{path}?busy_timeout_ms=2000", QUOTAS) as ledger:
        with locked(path, 0.6):
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(ledger.reserve("a", "cancelled", 1, 1), 0.1)
            # The abandoned call may still get the lock once it is free and commit whole; the next call runs
            # after it on the same thread, in a transaction of its own.
            second = await ledger.reserve("a", "next", 1, 1)
        assert second.status == "open"
        ids = {r.request_id for r in await ledger.reservations()}
        assert "next" in ids and ids <= {"cancelled", "next"}
        assert len(await ledger.events()) == len(ids)


def test_the_busy_timeout_is_a_url_parameter(tmp_path: Path) -> None:
    assert parse_url(f"sqlite:///{tmp_path}/l.db") == (f"{tmp_path}/l.db", DEFAULT_BUSY_TIMEOUT_MS)
    assert parse_url(f"sqlite:///{tmp_path}/l.db?busy_timeout_ms=250") == (f"{tmp_path}/l.db", 250)
    for bad in ("0", "-5", "1.5", "x", "", "600001", "nan"):
        with pytest.raises(ValueError, match="busy_timeout_ms must be a whole number"):
            check_url(f"sqlite:///{tmp_path}/l.db?busy_timeout_ms={bad}")
    for bad in ("?busy_timeout_ms=5&x=1", "?busy_timeout_ms=5&busy_timeout_ms=6", "?", "?busy_timeout_ms=5#x"):
        with pytest.raises(ValueError, match="takes no parameters"):
            check_url(f"sqlite:///{tmp_path}/l.db{bad}")
