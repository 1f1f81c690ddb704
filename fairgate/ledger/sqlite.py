"""The ledger on a SQLite file (the embedded default): WAL, one ``BEGIN IMMEDIATE`` transaction per call.

``BEGIN IMMEDIATE`` takes the database's write lock at the start, so calls from every process on the
file are serialised and each one reads the balances it then writes.

Every call runs off the event loop, whole, on the connection's own thread: with calls on the loop, another
process holding the write lock for 40 s froze /health and every stream for 40 s. A
call's coroutine (``SqlLedger``'s code) is driven to completion on that thread: its statements never
suspend there, so a transaction is one uninterrupted piece of work on one thread, and a caller cancelled
meanwhile gets no half-done transaction. Waiting for the write lock is bounded by ``busy_timeout_ms``
(URL ``sqlite:///path.db?busy_timeout_ms=N``, default ``DEFAULT_BUSY_TIMEOUT_MS``, 2 s), counted from when the
call starts; while the lock is known held elsewhere (a call gave up on it, none has had it since), from when
the call was made (all fail within one timeout, not one after another): past it the call raises
``LedgerUnavailable``, and the gateway applies the tier's ``on_ledger_unavailable`` policy. The clock is
this machine's wall clock (all processes share it).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qsl

from fairgate.ledger import urls
from fairgate.ledger.base import Ledger
from fairgate.ledger.config import Quotas
from fairgate.ledger.model import LedgerUnavailable
from fairgate.ledger.sql import TABLES, SqlLedger, Tx
from fairgate.ledger.sql_schema import ADDED_COLUMNS, add_column

SCHEME = "sqlite:///"
# How long a call may wait for the write lock. SQLite's busy handler polls (sleeps of 1, 2, 5, ... 100 ms) and
# loses the lock to processes re-taking it at once, so waits under saturation are long: with 2 to 8 processes
# running reserve + settle flat out on one file (2 cores), the slowest call took 0.23 to 1.0 s
# (bench/sqlite_offload.py). 2 s keeps a saturated but working ledger from looking down, and still turns a
# lock held by a stuck process or a long operator transaction into the tier's outage policy in 2 s, not 30.
DEFAULT_BUSY_TIMEOUT_MS = 2000
MAX_BUSY_TIMEOUT_MS = 600_000
T = TypeVar("T")


def parse_url(url: str) -> tuple[str, int]:
    """The file path and busy timeout (ms) of ``sqlite:///relative/path.db`` or ``sqlite:////absolute/path.db``
    (as in SQLAlchemy), optionally ``?busy_timeout_ms=N`` (N in [1, 600000]). Raises ``ValueError``."""
    if not isinstance(url, str):
        raise ValueError(f"ledger URL must be a string, got {type(url).__name__}")
    if not url.startswith(SCHEME) or url == SCHEME:
        raise ValueError(f"ledger URL {url!r}: expected sqlite:///relative/path.db or sqlite:////absolute/path.db")
    path, question, query = url[len(SCHEME) :].partition("?")
    pairs = parse_qsl(query, keep_blank_values=True)
    if "#" in url or not path or (question and [name for name, _ in pairs] != ["busy_timeout_ms"]):
        # a query or fragment would otherwise silently become part of the file name
        raise ValueError(
            f"ledger URL {url!r}: a sqlite URL takes no parameters (no '#'; '?' only for busy_timeout_ms=N)"
        )
    busy_timeout_ms = DEFAULT_BUSY_TIMEOUT_MS
    if question:
        value = urls.number(pairs[0][1])
        if not (1 <= value <= MAX_BUSY_TIMEOUT_MS and value == int(value)):
            raise ValueError(f"ledger URL {url!r}: busy_timeout_ms must be a whole number of ms in [1, 600000]")
        busy_timeout_ms = int(value)
    return path, busy_timeout_ms


def file_path(url: str) -> str:
    """The file path a sqlite URL names (``parse_url``). Raises ``ValueError``."""
    return parse_url(url)[0]


def check_url(url: str) -> None:
    """Check a ``sqlite:///`` URL (``parse_url``). Raises ``ValueError``."""
    parse_url(url)


async def open_ledger(url: str, quotas: Quotas, clock: Callable[[], float] | None, create: bool) -> Ledger:
    """``SqliteLedger`` on the file ``url`` names. Raises ``ValueError`` (a bad URL), ``LedgerUnavailable``."""
    path, busy_timeout_ms = parse_url(url)
    return SqliteLedger(path, quotas, clock, busy_timeout_s=busy_timeout_ms / 1000.0, create=create)


class _SqliteTx:
    """A transaction's statements, run where they are called (the connection's thread)."""

    def __init__(self, connection: sqlite3.Connection, path: Path) -> None:
        self._c = connection
        self._path = path

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.OperationalError as exc:  # locked, disk I/O, full: the ledger, not the caller
            raise LedgerUnavailable(f"sqlite ledger {self._path}: {exc}") from None

    async def fetchone(self, sql: str, params: dict[str, Any] | None = None) -> tuple[Any, ...] | None:
        with self._errors():
            return self._c.execute(sql, params or {}).fetchone()  # type: ignore[no-any-return]

    async def fetchall(self, sql: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        with self._errors():
            return self._c.execute(sql, params or {}).fetchall()

    async def execute(self, sql: str, params: dict[str, Any] | None = None) -> None:
        with self._errors():
            self._c.execute(sql, params or {})

    async def batch(self, statements: list[tuple[str, dict[str, Any]]]) -> list[list[tuple[Any, ...]]]:
        execute = self._c.execute
        with self._errors():
            return [execute(sql, params).fetchall() for sql, params in statements]


def _drive(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to its end without an event loop: a ledger call on the connection's thread never
    suspends (its statements run in place), so one ``send`` finishes it. Raises what it raises."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("a SQLite ledger call suspended on the ledger thread (it must not await other work)")


class SqliteLedger(SqlLedger):
    """Ledger on the SQLite file at ``path`` (created with its tables if missing).

    Args:
        clock: ms since the epoch (default: ``time.time``); tests pass a controllable one.
        busy_timeout_s: how long a call may wait for another process's write lock, from when it starts (from
            when it was made, while a call has given up on the lock and none has had it since) before it fails.
        create: make the file and tables if missing (``False``: the file must exist).
        in_thread: run calls on the connection's thread (the default); ``False`` runs them on the event
            loop, blocking it - only ``bench/sqlite_offload.py`` does, as its baseline.

    Raises:
        LedgerUnavailable: the file cannot be opened or stays locked past ``busy_timeout_s``.
    """

    def __init__(
        self,
        path: str | Path,
        quotas: Quotas,
        clock: Callable[[], float] | None = None,
        busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_MS / 1000.0,
        create: bool = True,
        in_thread: bool = True,
    ) -> None:
        super().__init__(quotas)
        self.path = Path(path)
        if self.path.exists() and not self.path.is_file():
            raise LedgerUnavailable(f"sqlite ledger {self.path}: not a regular file")
        if not create and not self.path.is_file():
            raise LedgerUnavailable(f"sqlite ledger {self.path}: no ledger there (not created by an operator command)")
        self._clock = clock or (lambda: time.time() * 1000.0)
        self.busy_timeout_s = busy_timeout_s
        self._in_thread = in_thread
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fairgate-sqlite")
        self._thread_id: int | None = None
        self._deadline = 0.0  # the running call's: when it must have the write lock (time.monotonic)
        self._stalled = False  # a call gave up on the write lock, and none has had it since
        self._busy_ms = -1  # the connection's busy timeout as last set
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._connection = sqlite3.connect(
                self.path, isolation_level=None, timeout=busy_timeout_s, check_same_thread=False
            )
            self._connection.execute("PRAGMA journal_mode=WAL")
            self._connection.execute("PRAGMA synchronous=NORMAL")
            self._connection.executescript(
                "BEGIN IMMEDIATE;"
                + TABLES.format(
                    real="REAL", serial="INTEGER PRIMARY KEY AUTOINCREMENT", minute="CAST(at_ms / 60000 AS INTEGER)"
                )
                + "COMMIT;"
            )
            self._add_columns()
        except (sqlite3.Error, OSError) as exc:
            raise LedgerUnavailable(f"sqlite ledger {self.path}: {exc}") from None

    def _add_columns(self) -> None:
        """Give a ledger file made before them the columns added since (``ADDED_COLUMNS``)."""
        for table, column in ADDED_COLUMNS:
            have = {row[1] for row in self._connection.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                self._connection.execute(add_column(table, column, "REAL"))

    async def _call(self, method: Callable[..., Coroutine[Any, Any, T]], *args: Any, **kwargs: Any) -> T:
        """``method(self, *args, **kwargs)`` run whole on the connection's thread (in place when already
        there: a call made by another call)."""
        if not self._in_thread or threading.get_ident() == self._thread_id:
            return await method(self, *args, **kwargs)
        made_s = time.monotonic()

        def job() -> T:
            # A call waits up to the busy timeout for the write lock from when it starts, however long it was
            # queued behind this process's own calls; but while the lock is known held elsewhere (a call gave
            # up on it, none has had it since), from when it was made: then every call fails within one
            # timeout, not one after another.
            started_s = time.monotonic()
            deadline = (made_s if self._stalled else started_s) + self.busy_timeout_s
            self._thread_id, self._deadline = threading.get_ident(), deadline
            return _drive(method(self, *args, **kwargs))

        return await asyncio.get_running_loop().run_in_executor(self._executor, job)

    def _set_busy_timeout(self) -> None:
        """Give the coming ``BEGIN`` what is left of the call's time to wait for the lock; raises
        ``LedgerUnavailable`` when none is left (queued behind calls that waited it out)."""
        if not self._in_thread:
            return  # the baseline waits the full busy timeout (sqlite3.connect's)
        left_ms = int((self._deadline - time.monotonic()) * 1000.0)
        if left_ms <= 0:
            raise LedgerUnavailable(
                f"sqlite ledger {self.path}: no write lock within {self.busy_timeout_s * 1000:g} ms "
                "(earlier calls of this process waited for it)"
            )
        if abs(left_ms - self._busy_ms) > 10:  # a call not queued behind a wait keeps the last setting (+-10 ms)
            self._connection.execute(f"PRAGMA busy_timeout = {left_ms}")
            self._busy_ms = left_ms

    @asynccontextmanager
    async def _transaction(self, begin: str = "BEGIN IMMEDIATE") -> AsyncIterator[Tx]:
        connection = self._connection
        try:
            self._set_busy_timeout()
            connection.execute(begin)
        except sqlite3.Error as exc:
            self._stalled = True  # the write lock is held elsewhere
            raise LedgerUnavailable(f"sqlite ledger {self.path}: {exc}") from None
        except LedgerUnavailable:
            self._stalled = True
            raise
        self._stalled = False
        try:
            yield _SqliteTx(connection, self.path)
        except BaseException:
            connection.execute("ROLLBACK")
            raise
        try:
            connection.execute("COMMIT")
        except sqlite3.Error as exc:
            connection.execute("ROLLBACK")
            raise LedgerUnavailable(f"sqlite ledger {self.path}: {exc}") from None

    def _read_transaction(self) -> AbstractAsyncContextManager[Tx]:
        # BEGIN DEFERRED reads a WAL snapshot without the write lock: usage() neither waits for nor holds up
        # writers in other processes.
        return self._transaction("BEGIN")

    async def _now_ms(self, tx: Tx) -> float:
        return float(self._clock())

    async def close(self) -> None:
        closing = self._connection.close
        if self._in_thread:
            await asyncio.get_running_loop().run_in_executor(self._executor, closing)
        else:
            closing()
        self._executor.shutdown(wait=False)


def _in_thread(method: Callable[..., Coroutine[Any, Any, T]]) -> Callable[..., Coroutine[Any, Any, T]]:
    @functools.wraps(method)
    async def call(self: SqliteLedger, *args: Any, **kwargs: Any) -> T:
        return await self._call(method, *args, **kwargs)

    return call


# Every coroutine method of ``SqlLedger`` (each call that opens a transaction, and the steps under them) runs on
# the connection's thread: wrapped here by name rather than listed, so a method added to ``SqlLedger`` later
# cannot run its transaction on the event loop (or from two threads) by being left off a list.
for _name, _method in list(vars(SqlLedger).items()):
    if inspect.iscoroutinefunction(_method) and _name not in vars(SqliteLedger):
        setattr(SqliteLedger, _name, _in_thread(_method))
