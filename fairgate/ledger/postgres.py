"""The ledger on PostgreSQL (psycopg 3, async pool): one transaction per call, a per-tenant advisory lock.

``pg_advisory_xact_lock(hash(tenant))`` serialises every call on a tenant across all gateway processes
(limits are global, not per process); the clock is the server's ``clock_timestamp()``, so processes with
different clocks agree. Tables live in the schema named by the URL's ``schema`` parameter (default
``public``), created if missing. ``timeout_s`` (default 2) bounds how long a call waits for a connection
before raising ``LedgerUnavailable``: on the request path an outage must be noticed fast.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlparse, urlunparse

import psycopg
from psycopg import sql as pgsql
import psycopg_pool
from psycopg_pool import AsyncConnectionPool

from fairgate.ledger.base import tenant_tag
from fairgate.ledger.config import Quotas
from fairgate.ledger.model import LedgerUnavailable
from fairgate.ledger.sql import TABLES, SqlLedger, Tx

_NAMED = re.compile(r"(?<!:):([a-z_]+)")
_SCHEMA = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def _convert(sql: str) -> str:
    return _NAMED.sub(r"%(\1)s", sql)


class _PgTx:
    def __init__(self, cursor: psycopg.AsyncCursor[Any], connection: psycopg.AsyncConnection[Any]) -> None:
        self._cursor = cursor
        self._connection = connection

    async def batch(self, statements: list[tuple[str, dict[str, Any]]]) -> list[list[tuple[Any, ...]]]:
        """All statements in one round trip (libpq pipeline mode), then every statement's rows."""
        async with self._connection.pipeline() as pipeline:
            cursors = [self._connection.cursor() for _ in statements]
            for cursor, (sql, params) in zip(cursors, statements):
                await cursor.execute(_convert(sql), params)  # type: ignore[arg-type]
            await pipeline.sync()
            return [await c.fetchall() if c.description is not None else [] for c in cursors]

    async def fetchone(self, sql: str, params: dict[str, Any] | None = None) -> tuple[Any, ...] | None:
        await self._cursor.execute(_convert(sql), params or {})  # type: ignore[arg-type]
        return await self._cursor.fetchone()

    async def fetchall(self, sql: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        await self._cursor.execute(_convert(sql), params or {})  # type: ignore[arg-type]
        return await self._cursor.fetchall()

    async def execute(self, sql: str, params: dict[str, Any] | None = None) -> None:
        await self._cursor.execute(_convert(sql), params or {})  # type: ignore[arg-type]


class PostgresLedger(SqlLedger):
    """Ledger on PostgreSQL. Build with ``await PostgresLedger.open(url, quotas)``."""

    def __init__(self, pool: AsyncConnectionPool, schema: str, quotas: Quotas,
                 clock: Callable[[], float] | None) -> None:
        super().__init__(quotas)
        self._pool = pool
        self.schema = schema
        self._clock = clock

    @classmethod
    async def open(cls, url: str, quotas: Quotas, clock: Callable[[], float] | None = None,
                   max_connections: int = 8) -> PostgresLedger:
        """Connect, create the schema and tables if missing.

        Raises:
            ValueError: a bad ``schema`` name. LedgerUnavailable: the server cannot be reached.
        """
        parts = urlparse(url)
        query = dict(parse_qsl(parts.query))
        schema = query.pop("schema", "public")
        if not _SCHEMA.match(schema):
            raise ValueError(f"ledger URL: schema {schema!r} must match {_SCHEMA.pattern}")
        try:
            timeout_s = float(query.pop("timeout_s", "2"))
        except ValueError:
            timeout_s = float("nan")
        if not 0 < timeout_s <= 600:
            raise ValueError("ledger URL: timeout_s must be a number of seconds in (0, 600]")
        dsn = urlunparse(parts._replace(scheme="postgresql", query=urlencode(query)))

        async def configure(connection: psycopg.AsyncConnection[Any]) -> None:
            await connection.execute(pgsql.SQL("SET search_path TO {}").format(pgsql.Identifier(schema)))
            await connection.commit()

        pool = AsyncConnectionPool(dsn, min_size=1, max_size=max_connections, open=False, configure=configure,
                                   timeout=timeout_s, kwargs={"connect_timeout": max(1, round(timeout_s))})
        try:
            await pool.open(wait=True, timeout=max(timeout_s, 5.0))
            async with pool.connection() as connection:
                await connection.execute(pgsql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(pgsql.Identifier(schema)))
                await connection.execute("SELECT pg_advisory_xact_lock(4242)")  # one creator at a time
                for statement in TABLES.format(real="DOUBLE PRECISION", serial="BIGSERIAL PRIMARY KEY").split(";"):
                    if statement.strip():
                        await connection.execute(statement)  # type: ignore[call-overload]
        except (psycopg.Error, OSError) as exc:
            await pool.close()
            raise LedgerUnavailable(f"postgres ledger: {exc}") from None
        except Exception:
            await pool.close()
            raise
        return cls(pool, schema, quotas, clock)

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[Tx]:
        try:
            async with self._pool.connection() as connection, connection.transaction(), connection.cursor() as cursor:
                yield _PgTx(cursor, connection)
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            raise LedgerUnavailable(f"postgres ledger: {exc}") from None
        except (TimeoutError, psycopg_pool.PoolTimeout) as exc:
            raise LedgerUnavailable(f"postgres ledger: no connection within the pool timeout ({exc})") from None

    async def _lock_tenant(self, tx: Tx, tenant: str) -> None:
        statement = self._lock_statement(tenant_tag(tenant))
        assert statement is not None
        await tx.execute(*statement)

    def _lock_statement(self, tag: str) -> tuple[str, dict[str, Any]] | None:
        # The tenant tag's 64 bits, as the signed bigint the advisory lock takes.
        return "SELECT pg_advisory_xact_lock(:key)", {"key": int(tag, 16) - (1 << 63)}

    def _now_statement(self) -> tuple[str, dict[str, Any]] | None:
        return None if self._clock is not None else ("SELECT extract(epoch from clock_timestamp()) * 1000", {})

    async def _now_ms(self, tx: Tx) -> float:
        if self._clock is not None:
            return float(self._clock())
        row = await tx.fetchone("SELECT extract(epoch from clock_timestamp()) * 1000")
        assert row is not None
        return float(row[0])

    async def close(self) -> None:
        await self._pool.close()

    async def drop_schema(self) -> None:
        """Drop this ledger's schema and everything in it (tests)."""
        async with self._pool.connection(timeout=30.0) as connection:
            await connection.execute(pgsql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(pgsql.Identifier(self.schema)))
