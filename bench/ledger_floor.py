"""The floor under the ledger's server time: what the server costs for the smallest write call of each
backend's kind, measured in the same run as the ledger (``bench/ledger_ops.py``), so that figures taken on a
slow or shared machine read as a multiple of what that machine does at the least.

- Redis: an FCALL of a function that returns at once, given a reserve call's keys and arguments (13 keys, 17
  arguments, one hash slot): ``INFO commandstats`` µs per call.
- PostgreSQL: ``BEGIN``, an ``UPDATE`` of one row, ``COMMIT`` in one pipeline from one connection: its
  backend's CPU per transaction (``/proc/<pid>/schedstat``; the server runs on this machine).
- SQLite: ``BEGIN IMMEDIATE``, an ``UPDATE`` of one row, ``COMMIT`` on a file in WAL mode with
  ``synchronous=NORMAL``, as the ledger opens it: this process's CPU per transaction.

A gateway request makes three ledger calls that write (reserve, claim, final settle); its floor is three.
"""

from __future__ import annotations

import sqlite3
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import psycopg
from redis.asyncio import Redis

CALLS = 2000  # Redis and SQLite calls timed
TRANSACTIONS = 500  # PostgreSQL transactions timed (each a WAL flush)
RESERVE_KEYS, RESERVE_ARGS = 13, 17  # a reserve call's shape (fairgate/ledger/redis/scripts/prelude.lua)
_LIBRARY = "#!lua name=fgbench_floor\nredis.register_function('fgbench_floor', function(keys, args) return 1 end)\n"


async def redis_floor_us(url: str) -> float:
    """µs of server time per FCALL of a function that returns at once, called with a reserve's shape."""
    client = Redis.from_url(urlunsplit(urlsplit(url)._replace(query="")), decode_responses=True)
    keys = [f"{{fgbench_floor}}:{i}" for i in range(RESERVE_KEYS)]
    args = ["1"] * RESERVE_ARGS
    try:
        await client.function_load(_LIBRARY, replace=True)
        before = (await client.info("commandstats")).get("cmdstat_fcall", {"calls": 0, "usec": 0})
        for _ in range(CALLS):
            await client.fcall("fgbench_floor", RESERVE_KEYS, *keys, *args)
        after = (await client.info("commandstats"))["cmdstat_fcall"]
        await client.function_delete("fgbench_floor")
        return float(after["usec"] - before["usec"]) / max(1, int(after["calls"]) - int(before["calls"]))
    finally:
        await client.aclose()


def _backend_cpu_ns(pid: int) -> int:
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


async def postgres_floor_us(url: str) -> float:
    """Backend CPU µs per transaction that updates one row (its own schema, dropped after)."""
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query) if k not in ("schema", "timeout_s", "pooler")]
    schema = f"fgbench_floor_{uuid.uuid4().hex[:8]}"
    async with await psycopg.AsyncConnection.connect(
        urlunsplit(parts._replace(query=urlencode(query))), autocommit=True
    ) as conn:
        await conn.execute(f"CREATE SCHEMA {schema}")
        try:
            await conn.execute(f"CREATE TABLE {schema}.t (id int PRIMARY KEY, n bigint)")
            await conn.execute(f"INSERT INTO {schema}.t VALUES (1, 0)")
            pid = conn.info.backend_pid
            before = _backend_cpu_ns(pid)
            for _ in range(TRANSACTIONS):
                async with conn.pipeline():
                    await conn.execute("BEGIN")
                    await conn.execute(f"UPDATE {schema}.t SET n = n + 1 WHERE id = 1")
                    await conn.execute("COMMIT")
            return (_backend_cpu_ns(pid) - before) / 1000.0 / TRANSACTIONS
        finally:
            await conn.execute(f"DROP SCHEMA {schema} CASCADE")


def sqlite_floor_us() -> float:
    """This process's CPU µs per transaction that updates one row of a WAL-mode file."""
    with tempfile.TemporaryDirectory() as tmp:
        conn = sqlite3.connect(Path(tmp) / "floor.db", isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, n INTEGER)")
            conn.execute("INSERT INTO t VALUES (1, 0)")
            before = time.process_time()
            for _ in range(CALLS):
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("UPDATE t SET n = n + 1 WHERE id = 1")
                conn.execute("COMMIT")
            return (time.process_time() - before) * 1e6 / CALLS
        finally:
            conn.close()


async def floor_us(backend: str, url: str) -> tuple[float, str]:
    """(µs per minimal write call of ``backend`` at ``url``, what was measured)."""
    if backend == "redis":
        return await redis_floor_us(url), f"an FCALL returning at once ({RESERVE_KEYS} keys, {RESERVE_ARGS} args)"
    if backend == "postgres":
        return await postgres_floor_us(url), "BEGIN; UPDATE one row; COMMIT (backend CPU)"
    return sqlite_floor_us(), "BEGIN IMMEDIATE; UPDATE one row; COMMIT (WAL, in-process CPU)"
