"""``reserve`` returns the balances behind the rate-limit headers (``Reservation.balances``) on every backend:
what ``account(tenant, model_class)`` reads right after it, for a new, a retried and a re-opened reservation,
in a class with limits of its own and without."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fairgate.ledger import Usage
from tests.ledger.conftest import LIMITS

QUOTAS = {
    "defaults": LIMITS,
    "tenants": {"a": {}, "big": {"model_class": {"large": {"max_concurrent": 2, "requests_per_minute": 30}}}},
}


@pytest.fixture
async def ledger(open_ledger, clock):  # type: ignore[no-untyped-def]
    return await open_ledger(QUOTAS, clock)


@pytest.mark.parametrize(("tenant", "model_class"), [("a", "default"), ("big", "default"), ("big", "large")])
async def test_a_new_reservation_returns_the_balances_account_reads(ledger, clock, tenant, model_class):
    r = await ledger.reserve(tenant, "r1", 100, 200, 50.0, model_class=model_class)
    assert r.balances is not None and r.balances == await ledger.account(tenant, model_class)
    assert (r.balances.concurrent, r.balances.requests_level, r.balances.input_level) == (1, 4.0, 2900.0)
    clock.advance(1.0)
    second = await ledger.reserve(tenant, "r2", 10, 20, 5.0, model_class=model_class)
    assert second.balances == await ledger.account(tenant, model_class)


async def test_a_retry_returns_the_balances_as_they_stand(ledger, clock):
    first = await ledger.reserve("a", "r1", 100, 200, 50.0)
    await ledger.reserve("a", "r2", 100, 200, 50.0)
    again = await ledger.reserve("a", "r1", 100, 200, 50.0)  # the original reservation, nothing deducted
    assert again == first and again.balances == await ledger.account("a")
    assert again.balances is not None and again.balances.concurrent == 2
    await ledger.settle(first.id, 100, 100, 40.0, final=True)
    done = await ledger.reserve("a", "r1", 100, 200, 50.0)
    assert done.status == "settled" and done.balances == await ledger.account("a")


async def test_a_reopened_reservation_returns_the_balances_after_it(ledger):
    r = await ledger.reserve("big", "r1", 100, 200, 50.0, model_class="large")
    await ledger.cancel(r.id, Usage())
    reopened = await ledger.reserve("big", "r1", 100, 200, 50.0, model_class="large")
    assert (reopened.id, reopened.status) == (r.id, "open")
    assert reopened.balances == await ledger.account("big", "large")
    assert reopened.balances is not None and reopened.balances.concurrent == 1


async def test_balances_are_not_part_of_the_record(ledger):
    r = await ledger.reserve("a", "r1", 1, 1, 0.0)
    stored = await ledger.get(r.id)
    assert stored.balances is None and stored == r and replace(r, balances=None) == r
    assert "balances" not in repr(r)
    assert all(x.balances is None for x in await ledger.reservations("a"))
    settled = await ledger.settle(r.id, 1, 1, 0.0, final=True)
    assert settled.balances is None
