"""Spend budgets and prices, on every backend: a reservation holds what its worst case costs at its class's price,
settlement replaces that by what was billed, the period is the calendar month (or day, UTC), a price change
reaches new reservations only, and the usage and events say what the billed usage cost."""

from __future__ import annotations

import datetime as dt
import sqlite3

import pytest

from fairgate.ledger import QuotaExceeded, Usage, connect, quotas_from_dict
from fairgate.ledger.sql_schema import ADDED_COLUMNS
from tests.ledger.conftest import FakeClock

# 2024-01-31 23:00 UTC: an hour before February.
JAN_31_23H_MS = dt.datetime(2024, 1, 31, 23, tzinfo=dt.UTC).timestamp() * 1000.0
FEB_1_MS = dt.datetime(2024, 2, 1, tzinfo=dt.UTC).timestamp() * 1000.0
MAR_1_MS = dt.datetime(2024, 3, 1, tzinfo=dt.UTC).timestamp() * 1000.0

QUOTAS = {
    "defaults": {"spend_budget": 0.01},  # 10,000 micros a month
    "tenants": {
        "a": {},
        "d": {"limits": {"spend_period": "day"}},
        "c": {"model_class": {"m": {"spend_budget": 0.006}}},
    },
    "pricing": {"model_class": {"m": {"input_per_mtok": 1.0, "output_per_mtok": 4.0, "gpu_per_s": 0.0005}}},
}
# At m's price: 100 in, 1,000 out, 2,000 GPU-ms cost 100 + 4,000 + 1,000 micros.
WORST_MICROS = 5100.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(JAN_31_23H_MS)


async def test_a_reservation_holds_its_worst_case_and_settles_to_what_was_billed(open_ledger, clock):
    ledger = await open_ledger(QUOTAS, clock)
    r = await ledger.reserve("a", "r1", 100, 1000, 2000.0, model_class="m")
    assert r.price == ledger.quotas.price("m")
    assert (await ledger.account("a", "*")).spend_used_micros == WORST_MICROS
    await ledger.reserve("a", "r2", 10, 10, 0.0, model_class="unpriced")  # costs nothing: fits
    with pytest.raises(QuotaExceeded) as refused:
        await ledger.reserve("a", "r3", 100, 1000, 2000.0, model_class="m")  # 5,100 + 5,100 > 10,000
    e = refused.value
    assert (e.dimension, e.limit, e.remaining) == ("spend_budget", 0.01, pytest.approx(0.0049))
    assert e.retry_after_s == pytest.approx((FEB_1_MS - JAN_31_23H_MS) / 1000.0)  # the next month
    await ledger.settle(r.id, 90, 100, 1000.0)  # partial: the worst case is still held
    assert (await ledger.account("a", "*")).spend_used_micros == WORST_MICROS
    await ledger.settle(r.id, 90, 200, 1500.0, final=True)  # 90 + 800 + 750
    assert (await ledger.account("a", "*")).spend_used_micros == 1640.0
    assert (await ledger.reserve("a", "r3", 100, 1000, 2000.0, model_class="m")).status == "open"
    usage = await ledger.usage("a", 3600)
    assert usage.spend_micros == 1640.0
    assert sum(e.spend_micros for e in await ledger.events("a")) == 1640.0


async def test_a_cancel_gives_the_hold_back_and_an_expiry_bills_what_was_settled(open_ledger, clock):
    ledger = await open_ledger(QUOTAS, clock)
    r = await ledger.reserve("a", "r1", 100, 1000, 2000.0, model_class="m")
    await ledger.cancel(r.id, Usage())
    assert (await ledger.account("a", "*")).spend_used_micros == 0.0
    r = await ledger.reserve("a", "r2", 100, 1000, 2000.0, model_class="m")
    await ledger.settle(r.id, 100, 50, 0.0)
    clock.advance(601)  # past the 600 s TTL
    assert [x.id for x in await ledger.expire_due(None)] == [r.id]
    assert (await ledger.account("a", "*")).spend_used_micros == 100 + 200.0
    assert (await ledger.usage("a", 3600)).spend_micros == 300.0


async def test_the_budget_is_per_calendar_month_and_per_day(open_ledger, clock):
    ledger = await open_ledger(QUOTAS, clock)
    for tenant in ("a", "d"):
        r = await ledger.reserve(tenant, "r1", 100, 1000, 2000.0, model_class="m")
        await ledger.settle(r.id, 100, 1000, 2000.0, final=True)
    clock.now_ms = FEB_1_MS + 1.0  # a new month, and a new day
    for tenant in ("a", "d"):
        assert (await ledger.reserve(tenant, "r2", 100, 1000, 2000.0, model_class="m")).status == "open"
        account = await ledger.account(tenant, "*")
        assert (account.spend_period_start_ms, account.spend_used_micros) == (FEB_1_MS, WORST_MICROS)
    clock.now_ms = FEB_1_MS + 86_400_000.0  # February 2nd: a new day, the same month
    await ledger.reserve("d", "r3", 100, 1000, 2000.0, model_class="m")  # the day's budget is fresh
    await ledger.reserve("a", "r3", 10, 10, 10.0, model_class="m")
    with pytest.raises(QuotaExceeded) as refused:
        await ledger.reserve("a", "r4", 100, 1000, 2000.0, model_class="m")
    assert refused.value.retry_after_s == pytest.approx((MAR_1_MS - clock.now_ms) / 1000.0)


async def test_a_worst_case_above_the_whole_budget_is_refused_for_good(open_ledger, clock):
    ledger = await open_ledger(QUOTAS, clock)
    with pytest.raises(QuotaExceeded) as refused:
        await ledger.reserve("a", "r1", 100, 3000, 0.0, model_class="m")  # 12,100 > 10,000
    assert (refused.value.dimension, refused.value.retry_after_s) == ("spend_budget", None)


async def test_a_class_budget_caps_inside_the_tenants(open_ledger, clock):
    ledger = await open_ledger(QUOTAS, clock)
    await ledger.reserve("c", "r1", 100, 1000, 2000.0, model_class="m")
    with pytest.raises(QuotaExceeded) as refused:  # the class's 6,000
        await ledger.reserve("c", "r2", 100, 300, 0.0, model_class="m")  # 6,400: fits the tenant's 10,000
    assert refused.value.limit == 0.006
    assert (await ledger.account("c", "m")).spend_used_micros == WORST_MICROS
    assert (await ledger.account("c", "*")).spend_used_micros == WORST_MICROS


async def test_a_price_change_reaches_new_reservations_and_settles_old_ones_at_their_price(open_ledger, clock):
    ledger = await open_ledger(QUOTAS, clock)
    old = await ledger.reserve("a", "r1", 100, 1000, 2000.0, model_class="m")
    cheaper = {**QUOTAS, "pricing": {"model_class": {"m": {"output_per_mtok": 2.0}}}}
    ledger.apply_quotas(quotas_from_dict(cheaper))
    new = await ledger.reserve("a", "r2", 100, 1000, 2000.0, model_class="m")
    assert (old.price.output_micros_per_token, new.price.output_micros_per_token) == (4.0, 2.0)
    assert (await ledger.account("a", "*")).spend_used_micros == WORST_MICROS + 2000.0
    await ledger.settle(old.id, 100, 10, 0.0, final=True)  # at its own price: 100 + 40
    await ledger.settle(new.id, 100, 10, 0.0, final=True)  # 20
    assert (await ledger.account("a", "*")).spend_used_micros == 140.0 + 20.0
    assert (await ledger.usage("a", 3600)).spend_micros == 160.0


async def test_a_reopened_reservation_is_charged_at_the_price_now(open_ledger, clock):
    ledger = await open_ledger(QUOTAS, clock)
    r = await ledger.reserve("a", "r1", 100, 1000, 2000.0, model_class="m")
    await ledger.cancel(r.id, Usage())
    ledger.apply_quotas(quotas_from_dict({**QUOTAS, "pricing": {"model_class": {"m": {"input_per_mtok": 2.0}}}}))
    again = await ledger.reserve("a", "r1", 100, 1000, 2000.0, model_class="m")
    assert (again.id, again.status, again.price.input_micros_per_token) == (r.id, "open", 2.0)
    assert (await ledger.account("a", "*")).spend_used_micros == 200.0


async def test_a_sqlite_ledger_made_before_prices_gains_their_columns(tmp_path):
    path = tmp_path / "old.db"
    ledger = await connect(f"sqlite:///{path}", quotas_from_dict(QUOTAS))
    r = await ledger.reserve("a", "r1", 100, 1000, 2000.0, model_class="m")
    await ledger.close()
    with sqlite3.connect(path) as db:  # the tables as they were before spend was booked
        for table, column in ADDED_COLUMNS:
            db.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    ledger = await connect(f"sqlite:///{path}", quotas_from_dict(QUOTAS))
    try:
        old = await ledger.get(r.id)
        assert old.price.input_micros_per_token == 0.0  # an old reservation was free
        await ledger.settle(r.id, 100, 10, 0.0, final=True)
        assert (await ledger.reserve("a", "r2", 100, 1000, 2000.0, model_class="m")).price == ledger.quotas.price("m")
        assert (await ledger.account("a", "*")).spend_used_micros == WORST_MICROS
    finally:
        await ledger.close()


async def test_a_reservation_closed_in_the_next_period_gives_its_hold_back_to_its_own(open_ledger, clock):
    """Made on January 31st and cancelled in February, a reservation takes nothing off February's spend: the
    hold of a reservation open in February stays, and February's budget is not overspent."""
    ledger = await open_ledger(QUOTAS, clock)
    january = await ledger.reserve("a", "jan", 0, 2000, 0.0, model_class="m")  # holds 8,000 in January
    clock.now_ms = FEB_1_MS + 60_000.0
    february = await ledger.reserve("a", "feb", 0, 2000, 0.0, model_class="m")  # holds 8,000 in February
    await ledger.cancel(january.id, Usage())
    assert (await ledger.account("a", "*")).spend_used_micros == 8000.0
    with pytest.raises(QuotaExceeded):
        await ledger.reserve("a", "feb2", 0, 1000, 0.0, model_class="m")  # 8,000 + 4,000 > 10,000
    await ledger.settle(february.id, 0, 500, 0.0, final=True)
    assert (await ledger.account("a", "*")).spend_used_micros == 2000.0


async def test_a_budget_of_exactly_n_requests_admits_the_nth(open_ledger, clock):
    """1.1 per million tokens is no exact double: 100k + 100k tokens cost 220000.00000000003 micros, and a
    budget of two such requests still admits two."""
    quotas = {
        "defaults": {"spend_budget": 0.44},
        "tenants": {"a": {}},
        "pricing": {"model_class": {"m": {"input_per_mtok": 1.1, "output_per_mtok": 1.1}}},
    }
    ledger = await open_ledger(quotas, clock)
    for i in range(2):
        assert (await ledger.reserve("a", f"r{i}", 100_000, 100_000, 0.0, model_class="m")).status == "open"
    with pytest.raises(QuotaExceeded):
        await ledger.reserve("a", "r2", 1, 1, 0.0, model_class="m")
