"""The ledger on PostgreSQL (psycopg 3, async pool): one transaction per call, a per-tenant advisory lock.

A call on the request path (reserve, claim, settle, cancel, an expiry, the queue steps) is one round trip: one
autocommit statement calling a server-side function (``postgres_functions.sql``, ``postgres_functions.py``) that
takes the tenant's lock, applies the rules and writes, as its own transaction; or, made while another call of
the process on the same tenant is in flight, one call of a batch of that tenant's calls in one transaction and
one commit (``postgres_batch``). A read outside a write (``account``) is one round trip too; the operator's and
the sweep's other calls run in ``_PgTx`` transactions. Each call, read and small write (a heartbeat, a reservation
read, the shared counters: ``SqlLedger._small_transaction``) is bounded in time (``postgres_batch.answered``: a
paused or unreachable server fails it as ``LedgerUnavailable``); the operator's listings and the sweep's search for
what is due are not.

``pg_advisory_xact_lock(hash(tenant))`` serialises every call on a tenant across all gateway processes
(limits are global, not per process), held until its transaction commits (a batch's: after all its calls); the
clock is the server's ``clock_timestamp()``, so processes with different clocks agree. Tables and functions live in the
schema named by the URL's ``schema`` parameter (default ``public``; not empty, not ``information_schema`` nor
``pg_*``), created if missing (the functions replaced) unless ``open(..., create=False)``. ``timeout_s``
(default 2, in (0, 600]) bounds connecting (libpq's ``connect_timeout``, at least 2 s, unless the URL sets
``connect_timeout``) and how long a call waits for a pooled connection before raising ``LedgerUnavailable``:
on the request path an outage must be noticed fast. Every other query parameter goes to libpq (``sslmode``,
``application_name``, ...); one libpq does not know, a bad value of one libpq checks, or any repeated
parameter is a ``ValueError``. ``open`` first makes one direct connection, so a failure to open is a one-line
``LedgerUnavailable`` with libpq's reason (connection refused, database "x" does not exist, ...), in about
``timeout_s``.

Behind a transaction-mode pooler (PgBouncer ``pool_mode = transaction``) give ``pooler=transaction``: no
statement is prepared on the server then. Nothing else depends on the session: the lock is
transaction-scoped and every statement names its tables and functions with the schema (no ``search_path``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any
from urllib.parse import quote, urlencode, urlunsplit

import psycopg
import psycopg_pool
from psycopg import pq
from psycopg import sql as pgsql
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool

from fairgate.ledger import postgres_functions as fn
from fairgate.ledger import rules, sql_schema, urls
from fairgate.ledger.base import Ledger, new_reservation_id
from fairgate.ledger.config import Limits, Quotas
from fairgate.ledger.model import LedgerError, LedgerUnavailable, Reservation, RunClaim, Usage
from fairgate.ledger.postgres_alive import AliveCheck, lent
from fairgate.ledger.postgres_batch import CallBatches, Refusal, answered
from fairgate.ledger.sql import TABLES, SqlLedger, Tx, tag_of
from fairgate.ledger.sql_schema import ADDED_COLUMNS, Statement, add_column
from fairgate.ledger.text import one_line as _one_line
from fairgate.ledger.text import redacted as _redacted

_NAMED = re.compile(r"(?<!:):([a-z_][a-z0-9_]*)")
_SCHEMA = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
# libpq's messages for a connection option it parsed but whose value it rejects (a bad URL, not an outage).
_BAD_OPTION = re.compile(
    r"^invalid .*(value|number)|^could not match \d+ .* to \d+ |"
    r"^invalid connection option|^invalid URI"
)
_POOL_LOGGER = logging.getLogger("psycopg.pool")
log = logging.getLogger("fairgate.ledger")
# Connections in one process's pool. Each call holds one for one transaction (a few ms); several gateway
# processes of 8 each stay well under PostgreSQL's default max_connections (100).
POOL_CONNECTIONS = 8
# Calls in one batch of a tenant's calls (postgres_batch).
BATCH_CALLS_MAX = 32
# A connection lost with the server is retried with a doubling delay (psycopg_pool: 1, 2, 4, 8 s...) until this
# long, then given up, and the next call that finds no connection connects at once. Left at psycopg_pool's 300 s,
# a process stayed unusable 3.5-4.2 s after a 10 s PostgreSQL stop (the attempt after the server was back came
# late), long enough for another process to expire its reservations before it replayed its journal.
RECONNECT_TIMEOUT_S = 2.0


def _unavailable(exc: psycopg.Error) -> bool:
    """Whether ``exc`` is the server's or the connection's state, not the call's: lost or refused connections,
    cancelled statements, lock and statement timeouts, deadlocks (psycopg's ``OperationalError``), and a server
    that takes no writes (SQLSTATE class 25: a hot standby after a failover, ``default_transaction_read_only``)."""
    return isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError) or (exc.sqlstate or "").startswith("25")


def _libpq_reason(exc: BaseException) -> str:
    """libpq's message, one line, without psycopg's ``connection is bad:`` / ``connection failed:`` lead."""
    text = _one_line(exc) or type(exc).__name__
    for lead in ("connection is bad: ", "connection failed: "):
        if text.startswith(lead):
            text = text[len(lead) :]
    return text


class _QuietPool(logging.Filter):
    """Drops ``psycopg.pool`` records about one pool (its reconnect warnings while ``open`` runs: the
    cause is raised as ``LedgerUnavailable`` instead)."""

    def __init__(self, pool_name: str) -> None:
        super().__init__()
        self.pool_name = pool_name
        self.cause: str | None = None  # the last connection error the pool met, one line

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            if self.pool_name not in record.getMessage():
                return True
        except Exception:
            return True
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) == 2 and isinstance(args[1], BaseException):  # "error connecting in %r: %s"
            self.cause = _libpq_reason(args[1])
        return False


@dataclass(frozen=True)
class PostgresUrl:
    """A checked ``postgresql://`` ledger URL."""

    dsn: str  # for libpq: the URL without our parameters (schema, timeout_s, pooler)
    schema: str
    timeout_s: float
    connect_kwargs: dict[str, Any]  # libpq's connect_timeout, unless the URL sets it; psycopg's prepare_threshold
    pooled: bool = False  # behind a transaction-mode pooler (``pooler=transaction``)

    def as_pooled(self) -> PostgresUrl:
        """These settings behind a transaction-mode pooler: no statement prepared, no cancel request."""
        return replace(self, pooled=True, connect_kwargs={**self.connect_kwargs, "prepare_threshold": None})


def parse_url(url: str) -> PostgresUrl:
    """Check and split a PostgreSQL ledger URL. Raises ``ValueError`` naming the part at fault."""
    parsed = urls.split(url)
    _, query = parsed.query()
    schema = query.pop("schema", "public")
    if not schema:
        raise ValueError("ledger URL: schema is empty; leave it out for 'public' or name one")
    if not _SCHEMA.match(schema):
        raise ValueError(f"ledger URL: schema {schema!r} must match {_SCHEMA.pattern}")
    if schema == "information_schema" or schema.startswith("pg_"):
        raise ValueError(f"ledger URL: schema {schema!r} is a PostgreSQL system schema; choose another name")
    timeout_s = urls.timeout_s(query.pop("timeout_s", None))
    pooler = query.pop("pooler", None)
    if pooler not in (None, "transaction"):
        raise ValueError(f"ledger URL: pooler {pooler!r}: the one value is 'transaction' (PgBouncer pool_mode)")
    # Percent-encoded, never '+' for a space: libpq decodes %XX only (application_name=my%20app was my+app).
    dsn = urlunsplit(parsed.parts._replace(scheme="postgresql", query=urlencode(query, quote_via=quote)))
    try:
        conninfo_to_dict(dsn)  # libpq parses it: an unknown parameter or a malformed URL fails here
    except psycopg.Error as exc:
        raise ValueError(f"ledger URL {parsed.shown!r}: {_one_line(exc)}") from None
    # libpq's connect_timeout is whole seconds, at least 2; a connect_timeout in the URL wins.
    kwargs: dict[str, Any] = {} if "connect_timeout" in query else {"connect_timeout": max(2, math.ceil(timeout_s))}
    if pooler == "transaction":
        # Behind a transaction-mode pooler a statement prepared on one server connection is not on the next.
        kwargs["prepare_threshold"] = None
    return PostgresUrl(dsn, schema, timeout_s, kwargs, pooled=pooler == "transaction")


def check_url(url: str) -> None:
    """Check a PostgreSQL ledger URL without connecting (``parse_url``). Raises ``ValueError``."""
    parse_url(url)


async def open_ledger(url: str, quotas: Quotas, clock: Callable[[], float] | None, create: bool) -> Ledger:
    """``PostgresLedger.open``."""
    return await PostgresLedger.open(url, quotas, clock, create=create)


# The ledger's tables, qualified with its schema in every statement: no session state (``SET search_path``)
# is needed, so a transaction-mode pooler (PgBouncer) may give each transaction another server connection.
_TABLE = re.compile(
    r"\b(fg_(?:accounts|runs|reservations|events|usage_minutes|frozen|heartbeats|claims|charges|occupancy))\b"
)


@lru_cache(maxsize=1024)
def _convert(sql: str, schema: str) -> str:
    """``sql`` for psycopg: ``:name`` placeholders as ``%(name)s``, tables as ``"schema".fg_...``."""
    qualified = _TABLE.sub(lambda m: f'"{schema}".{m.group(1)}', sql)
    return _NAMED.sub(r"%(\1)s", qualified)


# Transaction control, sent as statements in the pipeline (never prepared: nothing to plan).
_CONTROL = frozenset({"BEGIN", "COMMIT", "ROLLBACK"})


class _PgTx:
    """One transaction on a pooled autocommit connection, its ``BEGIN`` and ``COMMIT`` sent as statements in the
    pipeline so neither costs a round trip of its own: ``BEGIN`` goes with the first batch, ``COMMIT`` alone at
    the end (the operator's and the sweep's calls; the request path runs in server-side functions instead).
    ``explicit=False``: no ``BEGIN``/``COMMIT``, each batch its own implicit transaction (reads)."""

    def __init__(self, connection: psycopg.AsyncConnection[Any], schema: str, explicit: bool) -> None:
        self._connection = connection
        self._schema = schema
        self._pending: list[Statement] = [("BEGIN", {})] if explicit else []
        self._open = False  # BEGIN sent: the server holds a transaction

    async def _send(self, statements: list[Statement]) -> list[psycopg.AsyncCursor[Any]]:
        """The pending statements, then ``statements``, in one round trip (libpq pipeline mode: leaving the
        pipeline sends the one Sync and reads every result); the cursors of ``statements``."""
        queued, self._pending = self._pending, []
        self._open = self._open or bool(queued and queued[0][0] == "BEGIN")
        cursors = []
        async with self._connection.pipeline():
            for sql, params in [*queued, *statements]:
                cursor = self._connection.cursor()
                prepare = False if sql in _CONTROL else None
                await cursor.execute(_convert(sql, self._schema), params, prepare=prepare)
                cursors.append(cursor)
        return cursors[len(queued) :]

    async def batch(self, statements: list[Statement]) -> list[list[tuple[Any, ...]]]:
        """All statements in one round trip (with what is pending), then every statement's rows."""
        cursors = await self._send(statements)
        return [await c.fetchall() if c.description is not None else [] for c in cursors]

    async def fetchone(self, sql: str, params: dict[str, Any] | None = None) -> tuple[Any, ...] | None:
        (rows,) = await self.batch([(sql, params or {})])
        return rows[0] if rows else None

    async def fetchall(self, sql: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        (rows,) = await self.batch([(sql, params or {})])
        return rows

    async def execute(self, sql: str, params: dict[str, Any] | None = None) -> None:
        await self.batch([(sql, params or {})])

    async def commit(self) -> None:
        """``COMMIT``, one round trip; none when nothing was sent."""
        if self._open or any(sql != "BEGIN" for sql, _ in self._pending):
            await self._send([("COMMIT", {})])
            self._open = False

    async def rollback(self) -> None:
        """``ROLLBACK`` of a transaction the server holds (pending writes are dropped). Quiet: the error that
        led here is the one to raise, and the pool discards a broken connection."""
        self._pending = []
        if self._open:
            self._open = False
            try:
                await self._send([("ROLLBACK", {})])
            except psycopg.Error:
                pass


def _connect_s(dsn: str, connect_kwargs: dict[str, Any]) -> float:
    """The connect timeout in effect, s: ours, else the URL's ``connect_timeout`` (libpq: at least 2 s;
    0 = none)."""
    value = connect_kwargs.get("connect_timeout")
    if value is None:
        try:
            value = float(conninfo_to_dict(dsn).get("connect_timeout") or 0)
        except (psycopg.Error, ValueError):
            value = 0.0
    return float(max(2, value)) if value > 0 else 0.0


def _open_error(exc: psycopg.Error, dsn: str, connect_kwargs: dict[str, Any]) -> Exception:
    """The exception ``open`` raises for a failed first connection: libpq's reason, one line."""
    reason = _libpq_reason(exc)
    if _BAD_OPTION.match(reason):
        return ValueError(f"ledger URL: {reason}")
    if isinstance(exc, psycopg.errors.ConnectionTimeout):
        try:
            params = conninfo_to_dict(dsn)
        except psycopg.Error:
            params = {}
        where = f"{params.get('host') or 'the server'}:{params.get('port') or 5432}"
        return LedgerUnavailable(
            f"postgres ledger: {reason} ({where} did not answer within {_connect_s(dsn, connect_kwargs):g} s)"
        )
    return LedgerUnavailable(f"postgres ledger: {reason}")


async def _add_columns(connection: psycopg.AsyncConnection[Any], schema: str) -> None:
    """Give a schema made before them the columns added since (``ADDED_COLUMNS``). Only the missing ones: an
    ``ALTER TABLE`` locks the table whole even when it changes nothing, and deadlocks against processes
    already serving."""
    cursor = await connection.execute(
        "SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = %(schema)s",
        {"schema": schema},
    )
    have = {(table, column) for table, column in await cursor.fetchall()}
    for table, column in ADDED_COLUMNS:
        if (table, column) not in have:
            await connection.execute(add_column(table, column, "DOUBLE PRECISION"))


async def _require_functions(connection: psycopg.AsyncConnection[Any], schema: str, url: str) -> None:
    """Raise ``LedgerUnavailable`` unless the request path's functions, helpers included, are in ``schema``
    (``create=False``)."""
    names = fn.function_names()
    cursor = await connection.execute(
        "SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
        "WHERE n.nspname = %(schema)s AND p.proname = ANY(%(names)s)",
        {"schema": schema, "names": list(names)},
    )
    missing = sorted(set(names) - {name for (name,) in await cursor.fetchall()})
    if missing:
        raise LedgerUnavailable(
            f"postgres ledger: the ledger at {_redacted(url)} (create=False) lacks the functions {', '.join(missing)} "
            f"in schema {schema}: open it once with create=True (as the gateway does) to install them"
        )


async def _prepare(settings: PostgresUrl, url: str, create: bool) -> bool:
    """On one direct connection: create the schema and tables and (re)place the request path's functions
    (``create``), or check they exist. Returns whether a pooler or a proxy stands between (``_between``).

    A direct connection fails fast and with libpq's reason, where the pool would retry quietly until its
    timeout and say only "pool initialization incomplete". Raises ``LedgerUnavailable``, ``ValueError``.
    """
    try:
        connection = await psycopg.AsyncConnection.connect(settings.dsn, **settings.connect_kwargs)
    except psycopg.Error as exc:
        raise _open_error(exc, settings.dsn, settings.connect_kwargs) from None
    except OSError as exc:
        raise LedgerUnavailable(f"postgres ledger: {_one_line(exc) or type(exc).__name__}") from None
    schema = settings.schema
    try:
        async with connection:
            between = await _between(connection)
            if create:
                await connection.execute("SELECT pg_advisory_xact_lock(4242)")  # one creator at a time
                name_sql = pgsql.Identifier(schema)
                await connection.execute(pgsql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(name_sql))
                await connection.execute(pgsql.SQL("SET LOCAL search_path TO {}").format(name_sql))
                for statement in TABLES.format(
                    real="DOUBLE PRECISION",
                    serial="BIGSERIAL PRIMARY KEY",
                    minute="CAST(FLOOR(at_ms / 60000) AS BIGINT)",
                ).split(";"):
                    if statement.strip():
                        await connection.execute(statement)
                await _add_columns(connection, schema)
                for definition in fn.definitions(schema):
                    await connection.execute(definition)
            else:
                cursor = await connection.execute(
                    "SELECT to_regclass(format('%%I.fg_reservations', %(schema)s::text)) IS NOT NULL",
                    {"schema": schema},
                )
                row = await cursor.fetchone()
                if not (row and row[0]):
                    raise LedgerUnavailable(
                        f"postgres ledger: no ledger at {_redacted(url)} (create=False): "
                        f"no table {schema}.fg_reservations"
                    )
                await _require_functions(connection, schema, url)
            await connection.commit()
    except (psycopg.Error, OSError) as exc:
        raise LedgerUnavailable(f"postgres ledger: {_libpq_reason(exc)}") from None
    return between


async def _between(connection: psycopg.AsyncConnection[Any]) -> bool:
    """Whether something stands between ``connection`` and its server: the backend that runs its statements is not
    the one the connection was told of at its start (a pooler, PgBouncer's, answers that with a key of its own).
    Behind a transaction-mode pooler without ``pooler=transaction``, psycopg's prepared statements - named per
    client connection - met other clients' on the pooler's shared server connections: an outside tester's two
    ledgers behind one PgBouncer wrote acknowledged reservations into each other's schemas."""
    cursor = await connection.execute("SELECT pg_backend_pid()")
    row = await cursor.fetchone()
    return row is not None and row[0] != connection.info.backend_pid


async def _open_pool(settings: PostgresUrl, alive: AliveCheck) -> AsyncConnectionPool:
    """The pool, open, every connection on the ledger's schema, an idle one checked before it is lent
    (``alive``). Raises ``LedgerUnavailable``: the direct connection worked but the pool's did not (the reason is
    the pool's last connection error)."""
    schema, dsn, connect_kwargs = settings.schema, settings.dsn, settings.connect_kwargs
    name = f"fairgate-ledger-{schema}-{uuid.uuid4().hex[:8]}"
    pool = AsyncConnectionPool(
        dsn,
        min_size=1,
        max_size=POOL_CONNECTIONS,
        open=False,
        timeout=settings.timeout_s,
        reconnect_timeout=RECONNECT_TIMEOUT_S,
        # Autocommit: each call's BEGIN and COMMIT are statements in its pipeline (_PgTx), not psycopg's own,
        # which costs a round trip apiece.
        kwargs={**connect_kwargs, "autocommit": True},
        name=name,
        configure=alive.made,
        check=alive.check,
    )
    quiet = _QuietPool(name)
    _POOL_LOGGER.addFilter(quiet)
    try:
        await pool.open(wait=True, timeout=max(settings.timeout_s, _connect_s(dsn, connect_kwargs)) + 1.0)
    except (psycopg.Error, psycopg_pool.PoolTimeout, OSError) as exc:
        await pool.close()
        raise LedgerUnavailable(f"postgres ledger: {quiet.cause or _libpq_reason(exc)}") from None
    except BaseException:
        await pool.close()
        raise
    finally:
        _POOL_LOGGER.removeFilter(quiet)
    return pool


class PostgresLedger(SqlLedger):
    """Ledger on PostgreSQL. Build with ``await PostgresLedger.open(url, quotas)``."""

    def __init__(
        self,
        pool: AsyncConnectionPool,
        schema: str,
        quotas: Quotas,
        clock: Callable[[], float] | None,
        alive: AliveCheck | None = None,
        cancel: bool = True,
    ) -> None:
        super().__init__(quotas)
        self._pool = pool
        # Whether a call past its answer timeout is sent a cancel request (``postgres_batch.answered``): not
        # behind a transaction-mode pooler, where an outside tester's abandoned cancels crashed PgBouncer 1.18
        # and one landed on another client's statement.
        self._cancel = cancel
        self.alive = alive  # the pool's check of idle connections, when it has one
        self.schema = schema
        self._clock = clock
        self._books_by_tag: tuple[Quotas | None, dict[str, fn.TenantBooks]] = (None, {})
        self._batches = CallBatches(pool, schema, self._lone, BATCH_CALLS_MAX, cancel)

    @classmethod
    async def open(
        cls, url: str, quotas: Quotas, clock: Callable[[], float] | None = None, *, create: bool = True
    ) -> PostgresLedger:
        """Connect; create the schema and tables if missing (``create=True``, the default), or require them.

        Args:
            create: with ``False`` the ledger must exist already (the schema and its ``fg_reservations``
                table): operator commands use it so that a mistyped URL does not create an empty ledger.

        Raises:
            ValueError: a bad URL: a bad, empty or system ``schema``, a bad ``timeout_s``, a repeated
                parameter, a parameter libpq does not know or a value it rejects (``sslmode=bogus``).
            LedgerUnavailable: the server cannot be reached or refuses the connection (libpq's reason, one
                line), or ``create=False`` and there is no ledger at ``url``.
        """
        settings = parse_url(url)
        if await _prepare(settings, url, create) and not settings.pooled:
            log.warning(
                "postgres ledger: a pooler or proxy stands between this process and the server (the backend "
                "running the statements is not the one the connection began with): no statement is prepared and "
                "no cancel request sent, as with pooler=transaction; give it in the URL to say so"
            )
            settings = settings.as_pooled()
        alive = AliveCheck(settings.timeout_s)
        pool = await _open_pool(settings, alive)
        return cls(pool, settings.schema, quotas, clock, alive, cancel=not settings.pooled)

    @asynccontextmanager
    async def _transaction(self, explicit: bool = True, bounded: bool = False) -> AsyncIterator[Tx]:
        try:
            async with lent(self._pool) as connection, self._bounded(connection, bounded):
                tx = _PgTx(connection, self.schema, explicit)
                try:
                    yield tx
                    await tx.commit()
                except BaseException:
                    if connection.pgconn.pipeline_status != pq.PipelineStatus.OFF:
                        # Cancelled inside psycopg's pipeline entry (it yields once after turning pipeline mode
                        # on): the connection's state is unknown, so it is closed (the server rolls back and
                        # frees the lock) and the pool replaces it.
                        await connection.close()
                    else:
                        await tx.rollback()
                    raise
        except psycopg.Error as exc:
            if _unavailable(exc):
                raise LedgerUnavailable(f"postgres ledger: {_libpq_reason(exc)}") from None
            raise
        except TimeoutError as exc:
            raise LedgerUnavailable(
                f"postgres ledger: no connection within the pool timeout ({_one_line(exc)})"
            ) from None

    def _bounded(self, connection: psycopg.AsyncConnection[Any], bounded: bool) -> AbstractAsyncContextManager[Any]:
        """A read (``account`` is on the request path) or a small write (``_small_transaction``: ``heartbeat`` and
        ``get``, which the request path reaches too) bounded in time as a call is (``answered``); a write
        transaction of unknown size (the operator's listings, the sweep's search for what is due) not: its work
        has no bound known here."""
        return answered(connection, self._cancel) if bounded else contextlib.nullcontext()

    def _read_transaction(self) -> AbstractAsyncContextManager[Tx]:
        # No BEGIN ... COMMIT: a read is one round trip, its batch's statements one implicit transaction.
        return self._transaction(explicit=False, bounded=True)

    def _small_transaction(self) -> AbstractAsyncContextManager[Tx]:
        return self._transaction(bounded=True)

    # --- request path: one server-side function call each ------------------------------------------
    async def _call(self, function: str, params: dict[str, Any], refused: fn.Refused) -> tuple[Any, ...]:
        """``function``'s one row: sent alone or in a batch of this process's calls (``CallBatches``). Raises
        what ``refused`` maps a refusal to, ``LedgerUnavailable``."""
        try:
            outcome = await self._batches.call(function, params)
        except (TimeoutError, psycopg_pool.PoolTimeout) as exc:
            raise LedgerUnavailable(
                f"postgres ledger: no connection within the pool timeout ({_one_line(exc)})"
            ) from None
        except psycopg.Error as exc:
            # A refusal first: psycopg makes an error of an unknown SQLSTATE class an OperationalError.
            error: LedgerError | None = refused.error(exc.sqlstate, exc.diag.message_detail or "")
            if error is not None:
                raise error from None
            if _unavailable(exc):
                raise LedgerUnavailable(f"postgres ledger: {_libpq_reason(exc)}") from None
            raise
        if isinstance(outcome, Refusal):
            refusal = refused.error(outcome.sqlstate, outcome.detail)
            if refusal is None:  # a refusal this call cannot make: a defect of the functions
                raise RuntimeError(f"postgres ledger: {function}: {outcome.sqlstate} {outcome.message}")
            raise refusal
        return outcome

    async def _lone(self, function: str, params: dict[str, Any]) -> tuple[Any, ...]:
        """``function``'s one row: one autocommit statement, one round trip, its own transaction. Raises
        ``psycopg.OperationalError`` when no answer comes within ``ANSWER_TIMEOUT_S`` (``answered``)."""
        async with lent(self._pool) as connection, answered(connection, self._cancel):
            cursor = await connection.execute(fn.call(function, self.schema), params)
            row = await cursor.fetchone()
        assert row is not None
        return tuple(row)

    def _fixed_now(self) -> float | None:
        """The ledger's own clock, if it has one (the functions read the server's otherwise)."""
        return None if self._clock is None else float(self._clock())

    def _tenant_books(self, tag: str) -> fn.TenantBooks:
        """The configured tenant whose reservation ids start with ``tag``, with its books (kept per ``quotas``)."""
        quotas, by_tag = self._books_by_tag
        if quotas is not self.quotas:
            self._books_by_tag = quotas, by_tag = self.quotas, fn.books_by_tag(self.quotas)
        return by_tag.get(tag, fn.UNCONFIGURED)

    async def _reserve(
        self, args: rules.ReserveArgs, limits: Limits, claim_owner: str | None, claim_lease_ms: float
    ) -> Reservation:
        """``fg_reserve``: the reservation made or re-opened, or the request id's earlier one (its arguments
        checked here: ``rules.check_retry``; the function claims it only when they are the same), with the binding
        account's balances and the run claim asked (``rules.claim_on_reserve``)."""
        books = dict(self.books(args.tenant, args.model_class))
        claim = (claim_owner, claim_lease_ms)
        params = fn.reserve_params(args, new_reservation_id(args.tenant), limits, books, self._fixed_now(), claim)
        row = await self._call("fg_reserve", params, fn.Refused(tenant=args.tenant, books=books))
        code, r = fn.reserved(row)
        return rules.check_retry(r, args) if code == "existing" else r

    async def _close(self, reservation_id: str, billed: Usage | None, final: bool, kind: str) -> Reservation:
        """``fg_close``; ``billed`` None: what the reservation has billed when the function reads it (the sweep's
        expiry)."""
        tag = tag_of(reservation_id)
        params = {
            "lock": fn.lock_key(tag),
            "now": self._fixed_now(),
            "id": reservation_id,
            "kind": kind,
            "final": final,
            "input": None if billed is None else billed.input_tokens,
            "output": None if billed is None else billed.output_tokens,
            "gpu_ms": None if billed is None else billed.gpu_ms,
            **self._tenant_books(tag).params(),
        }
        refused = fn.Refused(reservation_id=reservation_id, billed=billed, kind=kind)
        row = await self._call("fg_close", params, refused)
        r = sql_schema.reservation(row[1:])
        if row[0] == "final":
            return rules.check_final_again(r, r.billed if billed is None else billed, final, kind)
        return r

    async def _claim(self, reservation_id: str, owner: str, lease_ms: float) -> RunClaim:
        """``fg_claim``."""
        params = {
            "lock": fn.lock_key(tag_of(reservation_id)),
            "now": self._fixed_now(),
            "id": reservation_id,
            "owner": owner,
            "lease_ms": lease_ms,
        }
        holder, until_ms, now_ms = await self._call("fg_claim", params, fn.Refused(reservation_id=reservation_id))
        return RunClaim(str(holder), float(until_ms), float(now_ms))

    async def _queue_step(self, reservation_id: str, enter: bool) -> Reservation:
        """``fg_queue_step``."""
        tag = tag_of(reservation_id)
        books = self._tenant_books(tag)
        params = {"lock": fn.lock_key(tag), "id": reservation_id, "enter": enter, **books.params()}
        refused = fn.Refused(reservation_id=reservation_id, tenant=books.tenant or "", books=books.by_key)
        row = await self._call("fg_queue_step", params, refused)
        return sql_schema.reservation(row[1:])

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
        async with lent(self._pool, timeout_s=30.0) as connection:
            await connection.execute(
                pgsql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(pgsql.Identifier(self.schema))
            )
