"""The PostgreSQL ledger's batches (``fairgate.ledger.postgres_batch``): calls on a tenant made while one of
the process's is in flight go as one transaction, each call's refusal its own; other tenants' calls do not
wait for them; a call whose caller left before it was sent is not sent; a batch whose connection is lost fails
every call in it and writes nothing; a call queued behind one that hangs fails fast and is never sent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import psycopg
import pytest

from fairgate.ledger import LedgerUnavailable, QuotaExceeded, connect, postgres_batch, quotas_from_dict
from fairgate.ledger import postgres_functions as fn
from fairgate.ledger.base import new_reservation_id, tenant_tag
from fairgate.ledger.postgres import PostgresLedger
from tests.ledger.conftest import LIMITS

# Tenants of these tests' own: an advisory lock's key is its tenant's, whatever the schema, and these tests
# hold locks for seconds while other tests run on the same database.
A, B = "batch-test-a", "batch-test-b"
LIMITS_BATCH = {**LIMITS, "requests_per_minute": 60_000, "requests_burst": 1_000, "max_concurrent": 10}
QUOTAS = {"tenants": {A: {"limits": LIMITS_BATCH}, B: {"limits": LIMITS_BATCH}}}


@asynccontextmanager
async def _opened(url: str) -> AsyncIterator[PostgresLedger]:
    opened = await connect(url, quotas_from_dict(QUOTAS))
    assert isinstance(opened, PostgresLedger)
    try:
        yield opened
    finally:
        await opened.drop_schema()
        await opened.close()


@pytest.fixture
async def ledger(backend_url) -> AsyncIterator[PostgresLedger]:  # type: ignore[no-untyped-def]
    async with _opened(backend_url("postgres")) as opened:
        yield opened


@pytest.fixture(params=["postgres", "pgbouncer"])
async def any_ledger(request: pytest.FixtureRequest, backend_url) -> AsyncIterator[PostgresLedger]:  # type: ignore[no-untyped-def]
    """Straight to PostgreSQL, and behind PgBouncer in transaction mode (a batch is one transaction there too)."""
    async with _opened(backend_url(request.param)) as opened:
        yield opened


def _reserve_params(request_id: str, tenant: str | None) -> dict[str, object]:
    """``fg_reserve``'s parameters for a reservation of ``A`` under ``request_id``, ``tenant`` as given."""
    return {
        "lock": fn.lock_key(tenant_tag(A)), "now": None, "id": new_reservation_id(A), "tenant": tenant,
        "request_id": request_id, "model_class": "default", "run_id": None, "tool_round": False, "input": 1,
        "output": 1, "estimate": 1.0, "price": [0.0, 0.0, 0.0], "ttl_s": 60.0, "keys": ["*"],
        "limits": [None] * 18, "owner": None, "lease_ms": 0.0,
    }  # fmt: skip


async def _count(ledger: PostgresLedger, request_ids: list[str]) -> int:
    async with ledger._pool.connection() as connection:
        cursor = await connection.execute(
            f'SELECT count(*) FROM "{ledger.schema}".fg_reservations WHERE request_id = ANY(%s)', [request_ids]
        )
        row = await cursor.fetchone()
    assert row is not None
    return int(row[0])


async def test_a_burst_is_one_batch_and_each_refusal_is_its_own(any_ledger: PostgresLedger) -> None:
    ledger = any_ledger
    calls = [ledger.reserve(A if i % 2 else B, f"r{i}", 100, 50, 10.0) for i in range(31)]
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    # Each tenant's first call alone, the others in one batch of that tenant's: beta 1 + 15, acme 1 + 14.
    assert (ledger._batches.batches, ledger._batches.batched_calls) == (2, 29)
    granted = [o for o in outcomes if not isinstance(o, BaseException)]
    refused = [o for o in outcomes if isinstance(o, QuotaExceeded)]
    assert len(granted) == 20 and len(refused) == 11  # max_concurrent 10 for each tenant, 16 and 15 asked
    assert {r.dimension for r in refused} == {"max_concurrent"}
    assert {r.tenant for r in granted} == {A, B}
    for tenant in (A, B):
        assert (await ledger.account(tenant)).concurrent == 10
    # What the callers got is what the ledger holds: the refused calls wrote nothing.
    assert await _count(ledger, [f"r{i}" for i in range(31)]) == 20
    settled = await asyncio.gather(*(ledger.settle(r.id, 100, 20, 8.0, final=True) for r in granted))
    assert {(s.status, s.billed.output_tokens) for s in settled} == {("settled", 20)}
    assert (ledger._batches.batches, ledger._batches.batched_calls) == (4, 29 + 18)
    for tenant in (A, B):
        account = await ledger.account(tenant)
        assert account.concurrent == 0
        assert account.gpu_window_used_ms == pytest.approx(80.0)


async def test_an_error_not_a_refusal_is_raised_as_the_call_alone_raises_it(ledger: PostgresLedger) -> None:
    good = ledger.reserve(A, "good", 100, 50, 10.0)
    bad_params = _reserve_params("bad", None)
    bad = ledger._call("fg_reserve", bad_params, fn.Refused(tenant=A))
    first = ledger.reserve(A, "first", 100, 50, 10.0)
    outcomes = await asyncio.gather(first, good, bad, return_exceptions=True)
    assert ledger._batches.batches == 1  # good and bad went together, bad failed in it and was sent again alone
    assert not isinstance(outcomes[1], BaseException) and outcomes[1].status == "open"
    assert isinstance(outcomes[2], psycopg.errors.NotNullViolation)
    assert await _count(ledger, ["first", "good", "bad"]) == 2


async def test_a_call_whose_caller_left_before_it_was_sent_is_not_sent(ledger: PostgresLedger) -> None:
    first = asyncio.create_task(ledger.reserve(A, "first", 100, 50, 10.0))
    await asyncio.sleep(0)  # first in flight
    left = asyncio.create_task(ledger.reserve(A, "left", 100, 50, 10.0))
    await asyncio.sleep(0)  # left queued behind it
    left.cancel()
    await first
    with pytest.raises(asyncio.CancelledError):
        await left
    await ledger.reserve(A, "after", 100, 50, 10.0)
    assert await _count(ledger, ["first", "left", "after"]) == 2


async def test_a_batch_whose_connection_is_lost_fails_every_call_and_writes_nothing(ledger: PostgresLedger) -> None:
    lock = fn.lock_key(tenant_tag(A))
    async with await psycopg.AsyncConnection.connect(ledger._pool.conninfo, autocommit=True) as holder:
        await holder.execute("SELECT pg_advisory_lock(%s)", [lock])  # acme's calls wait for it
        first = asyncio.create_task(ledger.reserve(A, "first", 100, 50, 10.0))
        await asyncio.sleep(0)
        batch = [asyncio.create_task(ledger.reserve(A, f"b{i}", 100, 50, 10.0)) for i in range(5)]
        other = await ledger.reserve(B, "other", 100, 50, 10.0)  # another tenant's call waits for none
        assert other.status == "open" and not any(t.done() for t in batch)
        await holder.execute("SELECT pg_terminate_backend(%s)", [await _backend_waiting_on(holder, lock)])
        with pytest.raises(LedgerUnavailable):
            await first
        # Then the five queued behind it go as one batch, which waits on the lock in its turn.
        await holder.execute("SELECT pg_terminate_backend(%s)", [await _backend_waiting_on(holder, lock)])
        outcomes = await asyncio.gather(*batch, return_exceptions=True)
        assert all(isinstance(o, LedgerUnavailable) for o in outcomes), outcomes
        await holder.execute("SELECT pg_advisory_unlock(%s)", [lock])
    assert await _count(ledger, ["first"] + [f"b{i}" for i in range(5)]) == 0
    assert (await ledger.account(A)).concurrent == 0
    again = await asyncio.gather(*(ledger.reserve(A, f"b{i}", 100, 50, 10.0) for i in range(5)))
    assert [r.status for r in again] == ["open"] * 5  # the pool replaced the connections; the retries go through


async def test_a_batch_the_driver_cannot_send_sends_each_call_alone(ledger: PostgresLedger) -> None:
    params = _reserve_params("nul\x00", A)
    first = ledger.reserve(A, "first", 100, 50, 10.0)
    bad = ledger._call("fg_reserve", params, fn.Refused(tenant=A))
    good = [ledger.reserve(A, f"g{i}", 100, 50, 10.0) for i in range(3)]
    outcomes = await asyncio.gather(first, bad, *good, return_exceptions=True)
    assert isinstance(outcomes[1], psycopg.DataError)  # as alone: a NUL cannot be sent
    assert [o.status for o in outcomes[2:]] == ["open"] * 3  # type: ignore[union-attr]
    assert ledger._batches.batches == 0
    assert await _count(ledger, ["first", "g0", "g1", "g2"]) == 4


async def _backend_waiting_on(connection: psycopg.AsyncConnection, lock: int) -> int:  # type: ignore[type-arg]
    """The pid of the backend waiting for advisory lock ``lock`` (polled: the batch is on its way)."""
    key = lock & 0xFFFF_FFFF_FFFF_FFFF  # a bigint key is shown as its high and low 32 bits, unsigned
    for _ in range(200):
        cursor = await connection.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
            "AND classid = %s::int8::oid AND objid = %s::int8::oid AND objsubid = 1",
            [key >> 32, key & 0xFFFF_FFFF],
        )
        row = await cursor.fetchone()
        if row is not None:
            return int(row[0])
        await asyncio.sleep(0.01)
    raise AssertionError("no backend waits on the lock")


async def test_a_call_queued_behind_calls_that_hang_fails_fast_and_is_never_sent(ledger: PostgresLedger) -> None:
    lock = fn.lock_key(tenant_tag(A))
    async with await psycopg.AsyncConnection.connect(ledger._pool.conninfo, autocommit=True) as holder:
        await holder.execute("SELECT pg_advisory_lock(%s)", [lock])
        hanging = asyncio.create_task(ledger.reserve(A, "hanging", 100, 50, 10.0))
        await asyncio.sleep(0)
        started = asyncio.get_running_loop().time()
        with pytest.raises(LedgerUnavailable, match="pool timeout"):
            await ledger.reserve(A, "queued", 100, 50, 10.0)
        waited_s = asyncio.get_running_loop().time() - started
        assert ledger._pool.timeout <= waited_s < ledger._pool.timeout + 1.0
        await holder.execute("SELECT pg_advisory_unlock(%s)", [lock])
    assert (await hanging).status == "open"
    await ledger.reserve(A, "after", 100, 50, 10.0)
    assert await _count(ledger, ["hanging", "queued", "after"]) == 2


async def test_a_call_with_no_answer_fails_after_the_answer_timeout(
    ledger: PostgresLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A server that takes the call and answers nothing: here acme's lock held by another session.
    monkeypatch.setattr(postgres_batch, "ANSWER_TIMEOUT_S", 0.5)
    lock = fn.lock_key(tenant_tag(A))
    async with await psycopg.AsyncConnection.connect(ledger._pool.conninfo, autocommit=True) as holder:
        await holder.execute("SELECT pg_advisory_lock(%s)", [lock])
        lone = asyncio.create_task(ledger.reserve(A, "lone", 100, 50, 10.0))
        await asyncio.sleep(0)
        batch = [asyncio.create_task(ledger.reserve(A, f"b{i}", 100, 50, 10.0)) for i in range(3)]
        started = asyncio.get_running_loop().time()
        with pytest.raises(LedgerUnavailable, match=r"no answer within 0\.5 s"):
            await lone
        outcomes = await asyncio.gather(*batch, return_exceptions=True)  # then sent as a batch, unanswered too
        waited_s = asyncio.get_running_loop().time() - started
        assert [str(o) for o in outcomes] == ["postgres ledger: no answer within 0.5 s (connection closed)"] * 3
        assert 1.0 <= waited_s < 3.0
        other = await ledger.reserve(B, "other", 100, 50, 10.0)  # another tenant's calls go on meanwhile
        assert other.status == "open"
        await holder.execute("SELECT pg_advisory_unlock(%s)", [lock])
    # The closed connections' calls were on the server already: their outcome is unknown to the caller, as
    # after any lost connection; whatever the server did with them, the account agrees with the rows.
    written = await _count(ledger, ["lone", "b0", "b1", "b2"])
    assert (await ledger.account(A)).concurrent == written
    assert (await ledger.reserve(A, "after", 100, 50, 10.0)).status == "open"


async def test_a_server_that_takes_no_writes_is_unavailable_alone_and_batched(
    ledger: PostgresLedger, backend_url
) -> None:  # type: ignore[no-untyped-def]
    # A hot standby after a failover answers every write with SQLSTATE 25006; the URL's options (a space in
    # them percent-encoded, as libpq reads a URL) set the same.
    url = backend_url("postgres").replace("?", "?options=-c%20default_transaction_read_only%3Don&", 1)
    url = url.replace(f"schema={_schema_of(url)}", f"schema={ledger.schema}")
    standby = await PostgresLedger.open(url, quotas_from_dict(QUOTAS), create=False)
    try:
        outcomes = await asyncio.gather(
            *(standby.reserve(A, f"ro{i}", 100, 50, 10.0) for i in range(4)), return_exceptions=True
        )
    finally:
        await standby.close()
    assert [type(o) for o in outcomes] == [LedgerUnavailable] * 4, outcomes
    assert all("read-only transaction" in str(o) for o in outcomes), outcomes
    assert await _count(ledger, [f"ro{i}" for i in range(4)]) == 0


async def test_a_lock_timeout_fails_a_batch_once_not_once_a_call(ledger: PostgresLedger, backend_url) -> None:  # type: ignore[no-untyped-def]
    url = backend_url("postgres").replace("?", "?options=-c%20lock_timeout%3D300&", 1)
    url = url.replace(f"schema={_schema_of(url)}", f"schema={ledger.schema}")
    timed = await PostgresLedger.open(url, quotas_from_dict(QUOTAS), create=False)
    lock = fn.lock_key(tenant_tag(A))
    try:
        async with await psycopg.AsyncConnection.connect(ledger._pool.conninfo, autocommit=True) as holder:
            await holder.execute("SELECT pg_advisory_lock(%s)", [lock])
            started = asyncio.get_running_loop().time()
            outcomes = await asyncio.gather(
                *(timed.reserve(A, f"lt{i}", 100, 50, 10.0) for i in range(8)), return_exceptions=True
            )
            waited_s = asyncio.get_running_loop().time() - started
            await holder.execute("SELECT pg_advisory_unlock(%s)", [lock])
    finally:
        await timed.close()
    assert [type(o) for o in outcomes] == [LedgerUnavailable] * 8, outcomes
    assert all("lock timeout" in str(o) for o in outcomes), outcomes
    assert waited_s < 1.5  # the lone call's 0.3 s, then the batch of the other seven's: not 7 x 0.3 s more
    assert await _count(ledger, [f"lt{i}" for i in range(8)]) == 0


def _schema_of(url: str) -> str:
    return url.split("schema=", 1)[1].split("&", 1)[0]
