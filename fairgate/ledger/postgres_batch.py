"""The PostgreSQL ledger's request-path calls of one process, batched: several in one transaction, one commit.

Each call is one statement calling a server-side function that takes its tenant's advisory lock
(``postgres_functions.sql``); as a transaction of its own it holds that lock through its commit's WAL flush, so
the calls on one tenant run one flush at a time whoever sends them, and every commit costs the backend about
as much CPU as a small call's work (``bench/ledger_ops.py``: three one-row ``UPDATE`` transactions ~690 µs of
backend CPU against ~1,240 µs for a gateway request's two calls). A batch pays one commit for all its calls.

Natural batching, as a database's group commit does it: a call made while fewer than ``in_flight_max`` calls or
batches of this process are in flight is sent at once, alone, as a statement of its own (a lone call waits for
nothing); a call made while they are all in flight is queued, and each one that ends sends what has queued, up
to ``calls_max`` calls, as one batch. The busier the ledger, the larger the batches.

A batch is one round trip: ``BEGIN``, every call through its ``fg_try_`` wrapper, ``COMMIT``. A wrapper runs
its call in a subtransaction of its own (a PL/pgSQL ``EXCEPTION`` block), so a refusal rolls back only what
that call wrote and comes back as columns. ``calls_max`` stays under 64, the subtransactions a backend tracks
in shared memory before every snapshot elsewhere has to look them up in ``pg_subtrans`` (PostgreSQL's
``PGPROC_MAX_CACHED_SUBXIDS``). The calls are sent in the order of their tenant locks, so two batches, of this
process or another, take the locks they share in the same order and do not deadlock each other.

A call whose error in a batch is not a refusal (SQLSTATE class ``FG``) is sent again alone, so it raises what
a lone call raises; a batch that fails as a whole on the server (rolled back: nothing of it written) sends each
of its calls again alone; a batch whose connection is lost fails each of its calls with that error, as a lone
call fails (the outcome unknown: the ledger's calls are idempotent and their callers ready for it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import pq
from psycopg_pool import AsyncConnectionPool

from fairgate.ledger import postgres_functions as fn

Row = tuple[Any, ...]
LoneCall = Callable[[str, dict[str, Any]], Awaitable[Row]]
REFUSAL_CLASS = "FG"  # the SQLSTATE class of the functions' refusals (postgres_functions.sql's header)
# Errors of the connection or the pool: a lone call is failed by them too (LedgerUnavailable), never re-sent.
_LOST = (psycopg.OperationalError, psycopg.InterfaceError, TimeoutError)


@dataclass(frozen=True)
class Refusal:
    """A call's refusal as a batch returns it: its SQLSTATE (class ``FG``), message and detail (``''``: none)."""

    sqlstate: str
    message: str
    detail: str


@dataclass
class _Queued:
    function: str
    params: dict[str, Any]
    answer: asyncio.Future[Row | Refusal]


class CallBatches:
    """One process's request-path calls, sent alone or batched (module docstring).

    Args:
        pool: the ledger's connection pool (a batch holds one connection for its round trip).
        schema: the ledger's schema.
        lone: sends one call as a statement of its own and returns its one row; raises what the server or the
            pool raise (``psycopg.Error``, ``TimeoutError``).
        in_flight_max: lone calls and batches in flight at once, at most (below the pool's size, so that the
            ledger's other transactions still find a connection).
        calls_max: calls in one batch, at most (below 64: see the module docstring).
    """

    def __init__(
        self, pool: AsyncConnectionPool, schema: str, lone: LoneCall, in_flight_max: int, calls_max: int
    ) -> None:
        if not 1 <= calls_max < 64 or in_flight_max < 1:
            raise ValueError(f"in_flight_max {in_flight_max} (>= 1), calls_max {calls_max} (1..63)")
        self._pool = pool
        self._schema = schema
        self._lone = lone
        self._in_flight_max = in_flight_max
        self._calls_max = calls_max
        self._in_flight = 0
        self._queue: list[_Queued] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.batches = 0  # batches of two calls or more sent and committed
        self.batched_calls = 0  # the calls in them

    async def call(self, function: str, params: dict[str, Any]) -> Row | Refusal:
        """``function`` (one of ``postgres_functions.FUNCTIONS``) with ``params``: its row, or its refusal when
        it ran in a batch (sent alone, a refusal is raised as ``lone`` raises it). Raises what ``lone`` raises."""
        if self._in_flight < self._in_flight_max and not self._queue:
            self._in_flight += 1
            try:
                return await self._lone(function, params)
            finally:
                self._in_flight -= 1
                self._send_queued()
        answer: asyncio.Future[Row | Refusal] = asyncio.get_running_loop().create_future()
        self._queue.append(_Queued(function, params, answer))
        self._send_queued()
        return await answer  # a caller cancelled before its call is sent cancels it: it is not sent

    def _send_queued(self) -> None:
        while self._queue and self._in_flight < self._in_flight_max:
            taken = [q for q in self._queue[: self._calls_max] if not q.answer.done()]
            del self._queue[: self._calls_max]
            if taken:
                self._in_flight += 1
                task = asyncio.create_task(self._run(taken))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _run(self, taken: list[_Queued]) -> None:
        try:
            if len(taken) == 1:
                await self._alone(taken[0])
            else:
                await self._batch(taken)
        finally:
            for q in taken:  # the task cancelled (the loop closing): none of its callers is left waiting
                if not q.answer.done():
                    _answer(q, psycopg.OperationalError("the ledger's batch ended without an answer"))
            self._in_flight -= 1
            self._send_queued()

    async def _alone(self, q: _Queued) -> None:
        try:
            row = await self._lone(q.function, q.params)
        except Exception as exc:
            _answer(q, exc)
        else:
            _answer(q, row)

    async def _batch(self, taken: list[_Queued]) -> None:
        taken.sort(key=lambda q: int(q.params["lock"]))  # stable: one tenant's calls stay in their order
        try:
            rows = await self._send(taken)
        except _LOST as exc:
            for q in taken:
                _answer(q, exc)
            return
        except psycopg.Error:  # rolled back as a whole: each call alone, one after another
            for q in taken:
                await self._alone(q)
            return
        self.batches += 1
        self.batched_calls += len(taken)
        again = []
        for q, row in zip(taken, rows, strict=True):
            state = row[0]
            if state is None:
                _answer(q, row[3:])
            elif state.startswith(REFUSAL_CLASS):
                _answer(q, Refusal(state, row[1] or "", row[2] or ""))
            else:
                again.append(q)
        for q in again:
            await self._alone(q)

    async def _send(self, taken: list[_Queued]) -> list[Row]:
        """``BEGIN``, the calls' wrappers, ``COMMIT``: one round trip (libpq's pipeline mode, one Sync)."""
        async with self._pool.connection() as connection:
            try:
                async with connection.pipeline():
                    await connection.execute("BEGIN", prepare=False)
                    cursors = [await connection.execute(fn.try_call(q.function, self._schema), q.params) for q in taken]
                    await connection.execute("COMMIT", prepare=False)
                rows = [await cursor.fetchone() for cursor in cursors]
            except BaseException:
                await _discard_transaction(connection)
                raise
        return [_one(row) for row in rows]


def _one(row: Row | None) -> Row:
    assert row is not None  # each wrapper returns one row, its error in it
    return tuple(row)


def _answer(q: _Queued, outcome: Row | Refusal | Exception) -> None:
    if q.answer.done():  # answered already, or its caller gone
        return
    if isinstance(outcome, Exception):
        q.answer.set_exception(outcome)
    else:
        q.answer.set_result(outcome)


async def _discard_transaction(connection: psycopg.AsyncConnection[Any]) -> None:
    """Leave ``connection`` idle for the pool, or closed (the pool replaces it) where its state is unknown:
    cancelled inside the pipeline, or the ``ROLLBACK`` failing."""
    if connection.broken or connection.pgconn.pipeline_status != pq.PipelineStatus.OFF:
        await connection.close()
        return
    if connection.pgconn.transaction_status != pq.TransactionStatus.IDLE:
        try:
            await connection.execute("ROLLBACK", prepare=False)
        except psycopg.Error:
            await connection.close()
