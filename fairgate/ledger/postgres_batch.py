"""The PostgreSQL ledger's request-path calls of one process, batched: several in one transaction, one commit.

Each call is one statement calling a server-side function that takes its tenant's advisory lock
(``postgres_functions.sql``); as a transaction of its own it holds that lock through its commit's WAL flush, so
the calls on one tenant run one flush at a time whoever sends them, and every commit costs the backend about
as much CPU as a small call's work (``bench/ledger_ops.py``: three one-row ``UPDATE`` transactions ~690 µs of
backend CPU against ~1,240 µs for a gateway request's two calls). A batch pays one commit for all its calls.

Natural batching, as a database's group commit does it, per tenant lock: a call on a tenant with no call of
this process in flight is sent at once, alone, as a statement of its own (it waits for nothing); a call made
while one is in flight is queued, and when that one ends what has queued, up to ``calls_max`` calls, goes as one
batch. Calls on one tenant wait for each other on its lock anyway; calls on other tenants never wait for them
here (a batch of several tenants would hold every lock it took while it waited for the next). The busier a
tenant, the larger its batches. A queued call not sent within the pool's timeout fails as a lone call that
finds no connection in it does (``PoolTimeout``), and is never sent; nor is one whose caller has gone.

A batch is one round trip: ``BEGIN``, the tenant's lock, every call through its ``fg_try_`` wrapper,
``COMMIT``. A wrapper runs its call in a subtransaction of its own (a PL/pgSQL ``EXCEPTION`` block), so a
refusal rolls back only what that call wrote and comes back as columns. ``calls_max`` stays under 64, the
subtransactions a backend tracks in shared memory before every snapshot elsewhere has to look them up in
``pg_subtrans`` (PostgreSQL's ``PGPROC_MAX_CACHED_SUBXIDS``).

A call whose error in a batch is not a refusal (SQLSTATE class ``FG``) is sent again alone, so it raises what
a lone call raises; so is every call of a batch the driver could not send (a value it cannot encode: nothing
written). A batch that finds no connection in the pool's timeout, loses its connection, has no answer within
``ANSWER_TIMEOUT_S`` (its statement cancelled, or on a server that takes no cancel its socket shut down, within
``CANCEL_WAIT_S`` more; its connection closed), or fails on the server's state (its tenant's lock not taken
within ``lock_timeout``, a cancelled statement, a deadlock) fails each of its calls with that error, as each
would fail alone (``LedgerUnavailable``; after a lost connection the outcome is unknown: the ledger's calls
are idempotent and their callers ready for it). A pooled connection idle for half a second or more is checked
before it is lent (``postgres_alive``), so one the server ended while it sat in the pool fails no batch; one the
server ends within that window fails the batch that takes it whole.

An advisory lock's key is its tenant's in every schema (``postgres_functions.lock_key``): two ledgers in two
schemas of one database serialise on a tenant name they share.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import pq
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from fairgate.ledger import postgres_functions as fn
from fairgate.ledger.postgres_alive import lent, shut_down

# How long a request-path call or batch waits for the server's answer before its connection is closed and it
# fails as a lost connection does (LedgerUnavailable: its outcome unknown, as after any lost connection). A
# server that accepts connections and answers nothing held each call for as long as it stalled. Longer than any
# answer seen under load (a call queues on its tenant's lock behind the other processes' batches), shorter than
# a client's patience.
ANSWER_TIMEOUT_S = 10.0
# How long a call past ANSWER_TIMEOUT_S waits for its cancel request to be taken, then for its statement to end.
CANCEL_WAIT_S = 1.0
Row = tuple[Any, ...]
LoneCall = Callable[[str, dict[str, Any]], Awaitable[Row]]
REFUSAL_CLASS = "FG"  # the SQLSTATE class of the functions' refusals (postgres_functions.sql's header)


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
    sent: bool = False


class CallBatches:
    """One process's request-path calls, sent alone or batched per tenant lock (module docstring).

    Args:
        pool: the ledger's connection pool (a batch holds one connection for its round trip); its ``timeout``
            bounds how long a queued call waits to be sent.
        schema: the ledger's schema.
        lone: sends one call as a statement of its own and returns its one row; raises what the server or the
            pool raise (``psycopg.Error``, ``TimeoutError``).
        calls_max: calls in one batch, at most (below 64: see the module docstring).
        cancel: whether a batch past its answer timeout is sent a cancel request (``answered``).
    """

    def __init__(
        self, pool: AsyncConnectionPool, schema: str, lone: LoneCall, calls_max: int, cancel: bool = True
    ) -> None:
        if not 1 <= calls_max < 64:
            raise ValueError(f"calls_max {calls_max}: 1..63")
        self._pool = pool
        self._cancel = cancel  # a batch past its answer timeout is sent a cancel request (``answered``)
        self._schema = schema
        self._lone = lone
        self._calls_max = calls_max
        # Tenant lock -> the calls queued on it; a lock is a key here while a call or batch on it is in flight.
        self._queues: dict[int, list[_Queued]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.batches = 0  # batches of two calls or more sent and committed
        self.batched_calls = 0  # the calls in them

    async def call(self, function: str, params: dict[str, Any]) -> Row | Refusal:
        """``function`` (one of ``postgres_functions.FUNCTIONS``) with ``params`` (its tenant lock in ``lock``):
        its row, or its refusal when it ran in a batch (sent alone, a refusal is raised as ``lone`` raises it).
        Raises what ``lone`` raises, ``PoolTimeout`` (queued, not sent within the pool's timeout)."""
        lock = int(params["lock"])
        queue = self._queues.get(lock)
        if queue is None:
            self._queues[lock] = []
            try:
                return await self._lone(function, params)
            finally:
                self._send_queued(lock)
        q = _Queued(function, params, asyncio.get_running_loop().create_future())
        queue.append(q)
        await self._wait_sent(q)
        return await q.answer

    async def _wait_sent(self, q: _Queued) -> None:
        """Wait until ``q`` is sent (or answered), at most the pool's timeout, as a lone call waits for a
        connection: behind a call that hangs (a server that stopped answering, a lock held elsewhere), the
        calls queued fail fast. A call not sent when it times out or its caller is cancelled is never sent.
        Raises ``PoolTimeout``."""
        try:
            await asyncio.wait([q.answer], timeout=self._pool.timeout)
        except asyncio.CancelledError:
            q.answer.cancel()  # not sent: never will be; sent: its answer dropped
            raise
        if not q.sent and not q.answer.done():
            q.answer.cancel()
            raise PoolTimeout(f"not sent within {self._pool.timeout:g} s: a call on its tenant in flight")

    def _send_queued(self, lock: int) -> None:
        """The calls queued on ``lock`` (its call in flight just ended), as one batch; or none left."""
        queue = self._queues[lock]
        while queue:
            taken = [q for q in queue[: self._calls_max] if not q.answer.done()]
            del queue[: self._calls_max]
            if taken:
                for q in taken:
                    q.sent = True
                task = asyncio.create_task(self._run(lock, taken))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                return
        del self._queues[lock]

    async def _run(self, lock: int, taken: list[_Queued]) -> None:
        try:
            if len(taken) == 1:
                await self._alone(taken[0])
            else:
                await self._batch(taken)
        finally:
            for q in taken:  # the task cancelled (the loop closing): none of its callers is left waiting
                if not q.answer.done():
                    _answer(q, psycopg.OperationalError("the ledger's batch ended without an answer"))
            self._send_queued(lock)

    async def _alone(self, q: _Queued) -> None:
        if q.answer.done():  # its caller gone: not sent
            return
        try:
            row = await self._lone(q.function, q.params)
        except Exception as exc:
            _answer(q, exc)
        else:
            _answer(q, row)

    async def _batch(self, taken: list[_Queued]) -> None:
        try:
            rows = await self._send(taken)
        except (psycopg.OperationalError, psycopg.InterfaceError, TimeoutError) as exc:
            # No connection, the connection lost, or the server's state (the tenant lock not taken within
            # lock_timeout, a cancelled statement, a deadlock): each call fails as it would alone.
            _fail(taken, exc)
            return
        except Exception:  # rolled back as a whole, or never sent: a value the driver cannot send
            for q in taken:
                await self._alone(q)
            return
        again = []
        for q, row in zip(taken, rows, strict=True):
            state = row[0]
            if state is None:
                _answer(q, row[3:])
            elif state.startswith(REFUSAL_CLASS):
                _answer(q, Refusal(state, row[1] or "", row[2] or ""))
            else:
                again.append(q)
        if len(again) < len(taken):
            self.batches += 1
            self.batched_calls += len(taken) - len(again)
        for q in again:
            await self._alone(q)

    async def _send(self, taken: list[_Queued]) -> list[Row]:
        """``BEGIN``, the tenant's lock, the calls' wrappers, ``COMMIT``: one round trip (libpq's pipeline mode,
        one Sync)."""
        async with lent(self._pool) as connection, answered(connection, self._cancel):
            try:
                async with connection.pipeline():
                    await connection.execute("BEGIN", prepare=False)
                    # The tenant's lock first, once: a lock_timeout then fails the batch once, not each call in
                    # turn (each call's own take of it is then the transaction's, at once).
                    await connection.execute("SELECT pg_advisory_xact_lock(%s::int8)", [taken[0].params["lock"]])
                    cursors = [await connection.execute(fn.try_call(q.function, self._schema), q.params) for q in taken]
                    await connection.execute("COMMIT", prepare=False)
                rows = [await cursor.fetchone() for cursor in cursors]
            except BaseException as exc:
                await _discard_transaction(connection)
                if isinstance(exc, psycopg.Error) and connection.closed:
                    # Closed for its unknown state: the COMMIT may have run (a server that ended the connection
                    # just after it: psycopg reports "cannot exit pipeline mode while busy").
                    raise psycopg.OperationalError(f"connection lost in a batch, its outcome unknown: {exc}") from exc
                raise
        return [_one(row) for row in rows]


@asynccontextmanager
async def answered(connection: psycopg.AsyncConnection[Any], cancel: bool = True) -> AsyncIterator[None]:
    """The block's round trips on ``connection`` answered within ``ANSWER_TIMEOUT_S``, else what runs on it
    stopped (``_stop``; with ``cancel`` False its socket shut down at once, no cancel request), ``connection``
    closed (the pool replaces it; the server rolls back what it has not committed) and
    ``psycopg.OperationalError`` raised. A block that ends well as its time runs out keeps its result, its
    connection closed all the same (a cancel may be on its way to whatever the backend runs next)."""
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task[None]] = []
    timer = loop.call_later(ANSWER_TIMEOUT_S, lambda: stopping.append(loop.create_task(_stop(connection, cancel))))
    try:
        yield
    except psycopg.Error:
        if not stopping:
            raise
        raise psycopg.OperationalError(f"no answer within {ANSWER_TIMEOUT_S:g} s (connection closed)") from None
    finally:
        timer.cancel()
        if stopping:  # the time ran out: the stop ends here, and the connection is not lent again
            stopping[0].cancel()
            await connection.close()


async def _stop(connection: psycopg.AsyncConnection[Any], cancel: bool) -> None:
    """Stop what runs on ``connection``: a cancel request (a live server ends the statement: a lock wait, say,
    writes nothing later), then, if the statement has not ended ``CANCEL_WAIT_S`` after it or the request
    was not taken within that time (a paused server's postmaster takes none), its socket shut down: the
    block fails at once as a lost connection. Left to asyncio's cancellation, psycopg waited 5 s for the
    cancel and 5 s more for the statement: a paused server held a call 20 s rather than 10."""
    if cancel:
        with contextlib.suppress(psycopg.Error, OSError):
            await connection.cancel_safe(timeout=CANCEL_WAIT_S)
            await asyncio.sleep(CANCEL_WAIT_S)
    shut_down(connection)


def _fail(taken: list[_Queued], exc: Exception) -> None:
    for q in taken:
        _answer(q, exc)


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
