"""The PostgreSQL ledger's request path on the wire (libpq's protocol trace of the pool's connection): each call is
one round trip (one server-side function call), and its writes are one atomic whole."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import AsyncIterator, Awaitable
from itertools import pairwise
from typing import TypeVar

import psycopg
import pytest
from psycopg import pq

from fairgate.ledger import connect, postgres_alive, quotas_from_dict
from fairgate.ledger.model import Usage
from fairgate.ledger.postgres import PostgresLedger, parse_url
from tests.ledger.conftest import LIMITS

T = TypeVar("T")
QUOTAS = {"tenants": {"acme": {"limits": {**LIMITS, "requests_per_minute": 6000, "requests_burst": 100}}}}


@pytest.fixture
async def ledger(backend_url) -> AsyncIterator[PostgresLedger]:  # type: ignore[no-untyped-def]
    opened = await connect(backend_url("postgres"), quotas_from_dict(QUOTAS))
    assert isinstance(opened, PostgresLedger)
    yield opened
    await opened.drop_schema()
    await opened.close()


def _round_trips(trace: str) -> int:
    """Round trips in a libpq trace: each run of the client's messages (F) answered by the server's (B)."""
    directions = [line.split("\t")[0] for line in trace.splitlines() if line[:2] in ("F\t", "B\t")]
    return sum(1 for before, now in pairwise(directions) if (before, now) == ("F", "B"))


async def _traced(ledger: PostgresLedger, call: Awaitable[T]) -> tuple[T, int]:
    """``call``'s result and its round trips. Calls one after another use the pool's one connection."""
    async with ledger._pool.connection() as connection:
        pgconn = connection.pgconn
    with tempfile.TemporaryFile("w+") as out:
        pgconn.trace(os.dup(out.fileno()))
        pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
        try:
            result = await call
        finally:
            pgconn.untrace()  # flushes the trace
        out.seek(0)
        return result, _round_trips(out.read())


async def test_each_call_on_the_request_path_is_one_round_trip(
    ledger: PostgresLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The call's own round trips: no check of the pooled connection, however long a stall between two calls.
    monkeypatch.setattr(postgres_alive, "ALIVE_BYPASS_S", 3600.0)
    # First the statements' preparation (psycopg prepares a statement on its sixth run).
    for i in range(6):
        r = await ledger.reserve("acme", f"warm-{i}", 10, 10, 1.0)
        await ledger.claim(r.id, "me", 60_000.0)
        await ledger.enqueue(r.id)
        await ledger.dequeue(r.id)
        await ledger.settle(r.id, 5, 5, 0.5, final=True)
        await ledger.cancel((await ledger.reserve("acme", f"warm-cancel-{i}", 10, 10, 1.0)).id, Usage(1, 0, 0.0))
    # reserve: one function call (the lock, the reads, the rules and the writes). Its balances come with it.
    r, trips = await _traced(ledger, ledger.reserve("acme", "req", 10, 10, 1.0))
    assert trips == 1
    assert r.balances is not None and r.balances.concurrent == 1
    claim, trips = await _traced(ledger, ledger.claim(r.id, "me", 60_000.0))
    assert (trips, claim.owner) == (1, "me")
    # reserve with the run claim (the gateway's call): one function call too, the claim decided in it.
    claimed, trips = await _traced(
        ledger, ledger.reserve("acme", "req-2", 10, 10, 1.0, claim_owner="me", claim_lease_ms=9e3)
    )
    assert trips == 1 and claimed.claim is not None and claimed.claim.held_by("me")
    assert claimed.claim.remaining_ms == 9e3 and claimed.balances is not None and claimed.balances.concurrent == 2
    retry = ledger.reserve("acme", "req-2", 10, 10, 1.0, claim_owner="you", claim_lease_ms=9e3)
    retried, trips = await _traced(ledger, retry)
    assert trips == 1 and retried.id == claimed.id and retried.claim is not None and retried.claim.owner == "me"
    await ledger.cancel(claimed.id, Usage())
    queued, trips = await _traced(ledger, ledger.enqueue(r.id))
    assert (trips, queued.queued) == (1, True)
    dequeued, trips = await _traced(ledger, ledger.dequeue(r.id))
    assert (trips, dequeued.queued) == (1, False)
    account, trips = await _traced(ledger, ledger.account("acme"))
    assert (trips, account.concurrent) == (1, 1)  # no BEGIN, no COMMIT, no lock
    partial, trips = await _traced(ledger, ledger.settle(r.id, 5, 2, 0.2))
    assert (trips, partial.status, partial.billed.output_tokens) == (1, "open", 2)
    settled, trips = await _traced(ledger, ledger.settle(r.id, 5, 5, 0.5, final=True))
    assert (trips, settled.status, settled.billed.output_tokens) == (1, "settled", 5)
    # The same request id again: the function finds it and writes nothing.
    again, trips = await _traced(ledger, ledger.reserve("acme", "req", 10, 10, 1.0))
    assert (trips, again.id) == (1, r.id)
    other = await ledger.reserve("acme", "other", 10, 10, 1.0)
    cancelled, trips = await _traced(ledger, ledger.cancel(other.id, Usage(3, 1, 0.0)))
    assert (trips, cancelled.status) == (1, "cancelled")


async def test_a_write_failing_inside_the_function_leaves_nothing_and_releases_the_lock(
    ledger: PostgresLedger, backend_url
) -> None:  # type: ignore[no-untyped-def]
    # fg_reserve writes the event after the reservation and the accounts: an event the server refuses fails the
    # call after those writes, in the one statement that is the call's transaction.
    async with await psycopg.AsyncConnection.connect(parse_url(backend_url("postgres")).dsn, autocommit=True) as admin:
        events = f'"{ledger.schema}".fg_events'
        await admin.execute(f"ALTER TABLE {events} ADD CONSTRAINT refused CHECK (requests < 0)")
        with pytest.raises(psycopg.errors.CheckViolation):
            await ledger.reserve("acme", "doomed", 10, 10, 1.0)
        await admin.execute(f"ALTER TABLE {events} DROP CONSTRAINT refused")
    assert await ledger.reservations("acme") == []
    assert (await ledger.account("acme")).concurrent == 0
    assert [e.kind for e in await ledger.events("acme")] == []
    # The tenant's lock went with the rolled-back statement and the connection is clean: the next call runs.
    r = await ledger.reserve("acme", "after", 10, 10, 1.0)
    assert (r.status, r.balances is not None and r.balances.concurrent) == ("open", 1)


async def test_a_retry_reopening_its_reservation_does_not_deadlock_with_another_process_sweeping(
    ledger: PostgresLedger,
    backend_url,  # type: ignore[no-untyped-def]
) -> None:
    """A retry of a request cancelled with nothing billed re-opens its reservation and deletes its heartbeat
    and claim; another gateway process's expiry sweep (``SqlLedger._due``) deletes those of reservations no
    longer open, heartbeat first. Here the sweep has deleted the heartbeat when the retry comes: the retry waits
    for the sweep, and both go through. (Writes merged into one statement deleted the claim first: deadlock.)"""
    r = await ledger.reserve("acme", "job", 10, 10, 1.0)
    await ledger.claim(r.id, "gw-1", 60_000.0)
    await ledger.cancel(r.id, Usage())
    table = f'"{ledger.schema}".fg_{{}} WHERE reservation_id IN (SELECT id FROM "{ledger.schema}".fg_reservations '
    not_open = "WHERE status <> 'open')"
    async with await psycopg.AsyncConnection.connect(parse_url(backend_url("postgres")).dsn) as sweeper:
        await sweeper.execute("BEGIN")
        await sweeper.execute("DELETE FROM " + table.format("heartbeats") + not_open)
        retry = asyncio.ensure_future(ledger.reserve("acme", "job", 10, 10, 1.0))
        await asyncio.sleep(0.3)  # the retry waits on the heartbeat row the sweep holds
        await sweeper.execute("DELETE FROM " + table.format("claims") + not_open)
        await sweeper.execute("COMMIT")
        again = await asyncio.wait_for(retry, 5.0)
    assert (again.id, again.status) == (r.id, "open")


async def test_a_call_cancelled_as_it_starts_leaves_no_pooled_connection_in_pipeline_mode(
    ledger: PostgresLedger,
) -> None:
    """A client hanging up cancels the call at any point, also inside psycopg's pipeline entry (which yields
    once after turning pipeline mode on): the connection goes back to the pool clean, or not at all."""
    for n in range(60):
        call = asyncio.ensure_future(ledger.reserve("acme", f"cut-{n}", 10, 10, 1.0))
        await asyncio.sleep(n * 40e-6)
        call.cancel()
        with contextlib.suppress(BaseException):
            await call
        await asyncio.sleep(0.01)  # psycopg's pool puts a returned connection back in a background task
        assert all(c.pgconn.pipeline_status == pq.PipelineStatus.OFF for c in list(ledger._pool._pool)), n
        for committed in await ledger.reservations("acme", status="open"):  # cut after its commit: as the gateway
            await ledger.cancel(committed.id, Usage())
    later = await ledger.reserve("acme", "later", 1, 1, 0.0)
    assert (later.status, (await ledger.account("acme")).concurrent) == ("open", 1)
