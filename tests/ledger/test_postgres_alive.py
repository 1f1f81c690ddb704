"""The PostgreSQL ledger's pool checks a connection idle ``ALIVE_BYPASS_S`` or longer before lending it
(``fairgate.ledger.postgres_alive``): connections the server ended while they sat in the pool are replaced, and
the calls and batches that come next go through; a connection lent within the window is lent unchecked. A paused
server holds a caller about the pool's timeout when its connection is checked, and about the answer timeout
(``postgres_batch.answered``) when its call is sent: neither waits on psycopg's cancel of an unanswered
statement."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import psycopg
import pytest

from fairgate.harness.postgres import throwaway_postgres_server
from fairgate.ledger import LedgerUnavailable, postgres_alive, postgres_batch, quotas_from_dict
from fairgate.ledger.postgres import POOL_CONNECTIONS, PostgresLedger
from tests.conftest import timing_claims_hold_here
from tests.ledger.conftest import LIMITS

# Tenants of these tests' own (an advisory lock's key is its tenant's, whatever the schema).
A, B = "alive-test-a", "alive-test-b"
MANY = [f"alive-test-{i}" for i in range(8)]  # calls on as many tenants at once take as many connections
LIMITS_ALIVE = {**LIMITS, "requests_per_minute": 60_000, "requests_burst": 1_000, "max_concurrent": 100}
QUOTAS = {"tenants": {t: {"limits": LIMITS_ALIVE} for t in (A, B, *MANY)}}


@pytest.fixture
async def named(backend_url) -> AsyncIterator[tuple[PostgresLedger, str]]:  # type: ignore[no-untyped-def]
    """A ledger whose connections carry an ``application_name`` of their own, and that name."""
    name = f"fg-alive-{uuid.uuid4().hex[:8]}"
    url = backend_url("postgres").replace("?", f"?application_name={name}&", 1)
    ledger = await PostgresLedger.open(url, quotas_from_dict(QUOTAS))
    try:
        yield ledger, name
    finally:
        await ledger.drop_schema()
        await ledger.close()


async def _end_connections(ledger: PostgresLedger, name: str) -> int:
    """End every server connection of ``ledger`` (named ``name``), as a restart or an idle timeout does; wait
    until they are gone. Returns how many there were."""
    conninfo = ledger._pool.conninfo
    async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True, application_name="admin") as admin:
        cursor = await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s", [name]
        )
        ended = len(await cursor.fetchall())
        for _ in range(100):
            cursor = await admin.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", [name])
            row = await cursor.fetchone()
            if row is not None and row[0] == 0:
                return ended
            await asyncio.sleep(0.05)
    raise AssertionError(f"the connections of {name} did not end")


async def _rows(ledger: PostgresLedger, request_ids: list[str]) -> set[str]:
    async with ledger._pool.connection() as connection:
        cursor = await connection.execute(
            f'SELECT request_id FROM "{ledger.schema}".fg_reservations WHERE request_id = ANY(%s)', [request_ids]
        )
        return {row[0] for row in await cursor.fetchall()}


async def test_calls_after_the_server_ended_the_idle_connections_go_through(named: tuple[PostgresLedger, str]) -> None:
    ledger, name = named
    # Several connections in the pool: a burst on two tenants (each tenant's lone call, then its batch).
    await asyncio.gather(*(ledger.reserve(A if i % 2 else B, f"warm{i}", 100, 50, 10.0) for i in range(12)))
    assert await _end_connections(ledger, name) >= 2
    await asyncio.sleep(postgres_alive.ALIVE_BYPASS_S + 0.1)
    batches_before = ledger._batches.batches
    ids = [f"after{i}" for i in range(12)]
    outcomes = await asyncio.gather(
        *(ledger.reserve(A if i % 2 else B, request_id, 100, 50, 10.0) for i, request_id in enumerate(ids)),
        return_exceptions=True,
    )
    assert [getattr(o, "status", o) for o in outcomes] == ["open"] * 12
    assert ledger._batches.batches - batches_before == 2  # each tenant's batch, on a connection checked first
    # What the callers were told is what the ledger holds: every reservation once, and each account agrees.
    assert await _rows(ledger, ids) == set(ids)
    assert [(await ledger.account(t)).concurrent for t in (A, B)] == [12, 12]


async def test_a_pool_of_dead_connections_fails_no_call(named: tuple[PostgresLedger, str]) -> None:
    ledger, name = named
    # Every connection of a full pool (8) ended, as a restart does. psycopg_pool's own loop, retrying a failed
    # check after a backoff, got a caller past at most three of them within the 2 s pool timeout.
    await ledger._pool.resize(POOL_CONNECTIONS, POOL_CONNECTIONS)
    await ledger._pool.wait(timeout=10.0)
    await asyncio.gather(*(ledger.reserve(t, f"warm-{t}", 100, 50, 10.0) for t in MANY))
    assert await _end_connections(ledger, name) == POOL_CONNECTIONS
    await asyncio.sleep(postgres_alive.ALIVE_BYPASS_S + 0.1)
    started = time.monotonic()
    alive, dead_before = ledger.alive, ledger.alive.dead if ledger.alive else 0
    ids = [f"one-by-one{i}" for i in range(3)]
    outcomes = [await ledger.reserve(A, request_id, 100, 50, 10.0) for request_id in ids]
    assert [o.status for o in outcomes] == ["open"] * 3
    assert alive is not None and alive.dead - dead_before == POOL_CONNECTIONS  # the first call got past them all
    assert await _rows(ledger, ids) == set(ids)
    assert time.monotonic() - started < 2.0  # well within the pool timeout: each dead one cost a round trip
    assert [(await ledger.account(t)).concurrent for t in MANY] == [1] * 8


@pytest.mark.parametrize("server", ["postgres", "pgbouncer"])
async def test_a_connection_lent_within_the_window_is_not_checked(
    server: str, backend_url, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    # Behind PgBouncer (transaction mode) too: the check's empty query is a statement it passes on.
    ledger = await PostgresLedger.open(backend_url(server), quotas_from_dict(QUOTAS))
    try:
        await _lent_within_the_window_unchecked(ledger, monkeypatch)
    finally:
        await ledger.drop_schema()
        await ledger.close()


async def _lent_within_the_window_unchecked(ledger: PostgresLedger, monkeypatch: pytest.MonkeyPatch) -> None:
    alive = ledger.alive
    assert alive is not None
    monkeypatch.setattr(postgres_alive, "ALIVE_BYPASS_S", 3600.0)
    before = alive.checks
    for i in range(10):
        await ledger.reserve(A, f"busy{i}", 100, 50, 10.0)
    assert alive.checks == before  # lent again and again within the window: no round trip added
    monkeypatch.setattr(postgres_alive, "ALIVE_BYPASS_S", 0.0)
    for i in range(3):
        await ledger.reserve(A, f"idle{i}", 100, 50, 10.0)
    assert alive.checks == before + 3  # each lend after the window: one check


Warm = Callable[[PostgresLedger], Awaitable[object]]
Call = Callable[[PostgresLedger, Any], Awaitable[object]]  # given what the warm-up returned
HANG_S = 30.0  # a paused call past this is taken as one nothing bounds


def _call_while_paused(warm: Warm, call: Call | None = None) -> tuple[BaseException | None, float, str]:
    """On a throwaway server, a ledger with a 1 s pool timeout: ``warm(ledger)``, then the server paused and
    ``call(ledger, what warm returned)`` made (default: a reserve; what it raised, the seconds it took), then the
    server resumed and one more call (its status)."""

    async def run() -> tuple[BaseException | None, float, str]:
        with throwaway_postgres_server() as server:
            ledger = await PostgresLedger.open(f"{server.url}?schema=alive&timeout_s=1", quotas_from_dict(QUOTAS))
            try:
                warmed = await warm(ledger)
                server.send_tree(signal.SIGSTOP)
                started = time.monotonic()
                try:
                    made = (call or (lambda ledger, _: ledger.reserve(A, "paused", 100, 50, 10.0)))(ledger, warmed)
                    await asyncio.wait_for(made, HANG_S)  # a call left unbounded fails the test, not hangs it
                    failure: BaseException | None = None
                except (LedgerUnavailable, TimeoutError) as exc:
                    failure = exc
                finally:
                    waited_s = time.monotonic() - started
                    server.send_tree(signal.SIGCONT)
                after = await ledger.reserve(A, "after", 100, 50, 10.0)
                return failure, waited_s, after.status
            finally:
                await ledger.close()

    return asyncio.run(run())


@pytest.mark.serial  # a server of its own, paused for seconds: a timing claim
def test_a_paused_server_fails_a_call_on_an_idle_connection_within_twice_the_pool_timeout() -> None:
    async def warm(ledger: PostgresLedger) -> None:
        # Several pooled connections, each idle past the window when the server pauses.
        await asyncio.gather(*(ledger.reserve(A if i % 2 else B, f"warm{i}", 100, 50, 10.0) for i in range(8)))
        await asyncio.sleep(postgres_alive.ALIVE_BYPASS_S + 0.1)

    failure, waited_s, after = _call_while_paused(warm)
    # A check of an idle connection waits the pool's timeout (1 s) for an answer, then its socket is shut down; the
    # pool gives up after at most two. Cancelled instead (psycopg's cancel request, unanswered), it took 11 s.
    assert isinstance(failure, LedgerUnavailable), failure
    assert after == "open"
    timing_claims_hold_here("a paused server's call fails within 3 x the pool timeout")
    assert waited_s < 3.0, waited_s


@pytest.mark.serial  # a server of its own, paused for seconds: a timing claim
@pytest.mark.parametrize("what", ["reserve", "account", "get", "heartbeat", "add_charges"])
def test_a_call_a_paused_server_does_not_answer_fails_soon_after_the_answer_timeout(
    what: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A read on the request path (the budgets' account) is bounded as a call is, and so are the small writes the
    # request path and the background rounds make (a reservation read in late billing, the sweep's heartbeat, the
    # shared counters): unbounded, each waited as long as the server stayed paused (outside testers' findings).
    monkeypatch.setattr(postgres_batch, "ANSWER_TIMEOUT_S", 1.0)
    monkeypatch.setattr(postgres_alive, "ALIVE_BYPASS_S", 3600.0)  # the call's own statement, no check first
    calls: dict[str, Call] = {
        "reserve": lambda ledger, _: ledger.reserve(A, "paused", 100, 50, 10.0),
        "account": lambda ledger, _: ledger.account(A),
        "get": lambda ledger, warm: ledger.get(warm.id),
        "heartbeat": lambda ledger, warm: ledger.heartbeat(warm.id),
        "add_charges": lambda ledger, _: ledger.add_charges("emu", {A: (1.0, 1, 1)}),
    }
    failure, waited_s, after = _call_while_paused(lambda ledger: ledger.reserve(A, "warm", 100, 50, 10.0), calls[what])
    print(f"{what} on a paused server: {failure} after {waited_s:.1f} s")
    assert str(failure) == "postgres ledger: no answer within 1 s (connection closed)"
    assert after == "open"
    timing_claims_hold_here(f"a paused server's {what} fails within 3 s of its 1 s answer timeout")
    # The cancel request untaken for CANCEL_WAIT_S (1 s), then the socket shut down. Left to asyncio's
    # cancellation, psycopg waited 5 s for the cancel and 5 s for the statement: 11 s.
    assert waited_s < 4.0, waited_s
