"""A property of ``reserve(..., claim_owner=...)``, on every backend: after any sequence of reserves with a run
claim (retries from several processes among them, some with other arguments), claims, settlements, cancels and
time passing, one ledger answering each reserve with its claim in one call and another answering it with a
reserve and then - on an open reservation - a ``claim``, as the gateway called them before, give the same answers
(the reservation, the claim as it stands, or the same refusal) and end with the same books."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fairgate.harness.ledger import drop_ledger
from fairgate.ledger import Ledger, LedgerError, QuotaExceeded, Usage, connect, quotas_from_dict
from tests.ledger.conftest import FakeClock

QUOTAS = quotas_from_dict(
    {
        "defaults": {"requests_per_minute": 600, "requests_burst": 6, "max_concurrent": 2, "reservation_ttl_s": 60},
        "tenants": {"t": {}},
    }
)
REQUESTS = 4  # request ids, so that retries (of open and final reservations) happen
OWNERS = ("gw-1", "gw-2", "gw-3")
LEASE_MS = 20_000.0

step = st.one_of(
    st.tuples(st.just("reserve"), st.integers(0, REQUESTS - 1), st.sampled_from(OWNERS), st.booleans()),
    st.tuples(st.just("claim"), st.integers(0, REQUESTS - 1), st.sampled_from(OWNERS)),
    st.tuples(st.just("settle"), st.integers(0, REQUESTS - 1)),
    st.tuples(st.just("cancel"), st.integers(0, REQUESTS - 1), st.booleans()),
    st.tuples(st.just("wait"), st.sampled_from([1.0, 15.0, 61.0])),
)


async def _reserve(ledger: Ledger, n: int, owner: str, other_args: bool, combined: bool) -> Any:
    """The answer to request ``n`` reserved for ``owner``: (reservation, claim) or the refusal."""
    output_tokens = 2 if other_args else 1
    try:
        if combined:
            r = await ledger.reserve("t", f"r{n}", 1, output_tokens, claim_owner=owner, claim_lease_ms=LEASE_MS)
            return _seen(r), r.claim
        r = await ledger.reserve("t", f"r{n}", 1, output_tokens)
        return _seen(r), None if r.is_final else await ledger.claim(r.id, owner, LEASE_MS)
    except QuotaExceeded as exc:
        return "QuotaExceeded", exc.dimension, exc.retry_after_s
    except LedgerError as exc:
        return type(exc).__name__


def _seen(r: Any) -> tuple[Any, ...]:
    """A reservation without its id (each ledger makes its own)."""
    return (r.request_id, r.status, r.billed, r.created_ms, r.expires_at_ms, r.final_ms, r.balances)


async def _play(ledger: Ledger, s: tuple[Any, ...], combined: bool) -> Any:
    """Step ``s`` on ``ledger`` (the clock moved already); its answer, without ids."""
    kind = s[0]
    if kind == "wait":
        return sorted(_seen(r) for r in await ledger.expire_due())
    if kind == "reserve":
        return await _reserve(ledger, s[1], s[2], s[3], combined)
    ids = {r.request_id: r.id for r in await ledger.reservations("t")}
    if f"r{s[1]}" not in ids:
        return None
    rid = ids[f"r{s[1]}"]
    try:
        if kind == "claim":
            return await ledger.claim(rid, s[2], LEASE_MS)
        if kind == "settle":
            return _seen(await ledger.settle(rid, 1, 1, 0.0, final=True))
        return _seen(await ledger.cancel(rid, Usage() if s[2] else Usage(1, 0, 0.0)))
    except LedgerError as exc:
        return type(exc).__name__


async def _books(ledger: Ledger) -> tuple[Any, ...]:
    every = sorted(await ledger.reservations("t"), key=lambda r: r.request_id)
    events = [(e.kind, e.requests, e.at_ms) for e in await ledger.events("t")]
    return [_seen(r) for r in every], events, await ledger.account("t")


@pytest.mark.parametrize("backend", ["sqlite", "postgres", "redis"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(step, min_size=1, max_size=25))
def test_reserve_with_its_claim_answers_as_reserve_then_claim(
    backend: str, backend_url: Callable[[str], str], steps: list[tuple[Any, ...]]
) -> None:
    def fresh() -> str:  # a ledger of its own per example and side
        url = backend_url(backend)
        return url.replace(".db", f"_{uuid.uuid4().hex[:6]}.db") if backend == "sqlite" else url + uuid.uuid4().hex[:6]

    async def run() -> None:
        clock = FakeClock()
        one, two = await connect(fresh(), QUOTAS, clock), await connect(fresh(), QUOTAS, clock)
        try:
            for s in steps:
                if s[0] == "wait":
                    clock.advance(s[1])
                combined, separate = await _play(one, s, True), await _play(two, s, False)
                assert combined == separate, s
            assert await _books(one) == await _books(two)
        finally:
            for ledger in (one, two):
                await drop_ledger(ledger)
                await ledger.close()

    asyncio.run(run())
