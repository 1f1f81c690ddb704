"""The ledger on a SQLite file (the embedded default): WAL, one ``BEGIN IMMEDIATE`` transaction per call.

``BEGIN IMMEDIATE`` takes the database's write lock at the start, so calls from every process on the
file are serialised and each one reads the balances it then writes. Statements run on the event-loop
thread: each call is a few short statements on a local file (tens of microseconds), cheaper than a
hand-off to a thread. The clock is this machine's wall clock (all processes share it).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fairgate.ledger.base import Ledger
from fairgate.ledger.config import Quotas
from fairgate.ledger.model import LedgerUnavailable
from fairgate.ledger.sql import TABLES, SqlLedger, Tx

SCHEME = "sqlite:///"


def file_path(url: str) -> str:
    """The file path of ``sqlite:///relative/path.db`` or ``sqlite:////absolute/path.db`` (as in SQLAlchemy).
    Raises ``ValueError``."""
    if not url.startswith(SCHEME) or url == SCHEME:
        raise ValueError(f"ledger URL {url!r}: expected sqlite:///relative/path.db or sqlite:////absolute/path.db")
    if "?" in url or "#" in url:  # a query would silently become part of the file name
        raise ValueError(f"ledger URL {url!r}: a sqlite URL takes no parameters (no '?' or '#')")
    return url[len(SCHEME) :]


def check_url(url: str) -> None:
    """Check a ``sqlite:///`` URL (``file_path``). Raises ``ValueError``."""
    file_path(url)


async def open_ledger(url: str, quotas: Quotas, clock: Callable[[], float] | None, create: bool) -> Ledger:
    """``SqliteLedger`` on the file ``url`` names. Raises ``ValueError`` (a bad URL), ``LedgerUnavailable``."""
    return SqliteLedger(file_path(url), quotas, clock, create=create)


class _SqliteTx:
    def __init__(self, connection: sqlite3.Connection) -> None:
        self._c = connection

    async def fetchone(self, sql: str, params: dict[str, Any] | None = None) -> tuple[Any, ...] | None:
        return self._c.execute(sql, params or {}).fetchone()  # type: ignore[no-any-return]

    async def fetchall(self, sql: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        return self._c.execute(sql, params or {}).fetchall()

    async def execute(self, sql: str, params: dict[str, Any] | None = None) -> None:
        self._c.execute(sql, params or {})

    async def batch(self, statements: list[tuple[str, dict[str, Any]]]) -> list[list[tuple[Any, ...]]]:
        execute = self._c.execute
        return [execute(sql, params).fetchall() for sql, params in statements]


class SqliteLedger(SqlLedger):
    """Ledger on the SQLite file at ``path`` (created with its tables if missing).

    Args:
        clock: ms since the epoch (default: ``time.time``); tests pass a controllable one.
        busy_timeout_s: how long a call waits for another process's transaction before failing.
        create: make the file and tables if missing (``False``: the file must exist).

    Raises:
        LedgerUnavailable: the file cannot be opened or stays locked past ``busy_timeout_s``.
    """

    def __init__(
        self,
        path: str | Path,
        quotas: Quotas,
        clock: Callable[[], float] | None = None,
        busy_timeout_s: float = 30.0,
        create: bool = True,
    ) -> None:
        super().__init__(quotas)
        self.path = Path(path)
        if self.path.exists() and not self.path.is_file():
            raise LedgerUnavailable(f"sqlite ledger {self.path}: not a regular file")
        if not create and not self.path.is_file():
            raise LedgerUnavailable(f"sqlite ledger {self.path}: no ledger there (not created by an operator command)")
        self._clock = clock or (lambda: time.time() * 1000.0)
        self._lock = asyncio.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._connection = sqlite3.connect(
                self.path, isolation_level=None, timeout=busy_timeout_s, check_same_thread=False
            )
            self._connection.execute("PRAGMA journal_mode=WAL")
            self._connection.execute("PRAGMA synchronous=NORMAL")
            self._connection.executescript(
                "BEGIN IMMEDIATE;" + TABLES.format(real="REAL", serial="INTEGER PRIMARY KEY AUTOINCREMENT") + "COMMIT;"
            )
        except (sqlite3.Error, OSError) as exc:
            raise LedgerUnavailable(f"sqlite ledger {self.path}: {exc}") from None

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[Tx]:
        async with self._lock:
            connection = self._connection
            try:
                connection.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise LedgerUnavailable(f"sqlite ledger {self.path}: {exc}") from None
            try:
                yield _SqliteTx(connection)
            except BaseException:
                connection.execute("ROLLBACK")
                raise
            try:
                connection.execute("COMMIT")
            except sqlite3.Error as exc:
                connection.execute("ROLLBACK")
                raise LedgerUnavailable(f"sqlite ledger {self.path}: {exc}") from None

    async def _now_ms(self, tx: Tx) -> float:
        return float(self._clock())

    async def close(self) -> None:
        self._connection.close()
