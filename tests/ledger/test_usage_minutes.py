"""``usage()`` reads per-minute running totals plus the window's first, partial minute's events; on every
backend it must equal what the event log sums to over the same window, whatever the sequence of calls and
wherever the window starts (on, just before or just after a minute boundary). GPU amounts are multiples of
1/4 ms, so every sum is exact and the comparison is ``==``."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fairgate.harness.ledger import drop_ledger
from fairgate.ledger import Ledger, LedgerError, TenantUsage, Usage, connect, quotas_from_dict
from fairgate.ledger.model import usage_from_events
from fairgate.ledger.usage_minutes import MINUTE_MS, first_full_minute, minute_of
from tests.ledger.conftest import FakeClock

QUOTAS = quotas_from_dict(
    {
        "defaults": {"requests_per_minute": 1e9, "requests_burst": 1e9, "max_concurrent": 1000},
        "tenants": {"a": {}, "b": {}},
    }
)
quarter = st.integers(0, 4000).map(lambda n: n / 4)
step = st.tuples(
    st.sampled_from([0.0, 0.25, 1.0, 59.75, 60.0, 61.5, 3600.0]),  # seconds the clock moves first
    st.sampled_from(["a", "b"]),
    st.sampled_from(["reserve", "settle", "settle_final", "cancel"]),
    st.integers(0, 100),
    st.integers(0, 100),
    quarter,
)
WINDOWS = (0.001, 1.0, 59.75, 60.0, 60.25, 119.5, 600.0, 3600.0, 86_400.0, 315_360_000.0)


def expected(events: list, tenant: str, since_ms: float, window_s: float, by_status: dict[str, int]) -> TenantUsage:
    """The definition: the tenant's events in the window, summed one by one."""
    return usage_from_events(
        tenant, window_s, [e for e in events if e.tenant == tenant and e.at_ms >= since_ms], by_status
    )


async def _play(ledger: Ledger, clock: FakeClock, steps: list) -> None:
    made: dict[str, list[str]] = {"a": [], "b": []}
    for i, (advance_s, tenant, action, tokens_in, tokens_out, gpu_ms) in enumerate(steps):
        clock.advance(advance_s)
        try:
            if action == "reserve" or not made[tenant]:
                r = await ledger.reserve(tenant, f"r{i}", 100, 100, 50.0)
                made[tenant].append(r.id)
            elif action == "cancel":
                await ledger.cancel(made[tenant][-1], Usage(tokens_in, tokens_out, gpu_ms))
            else:
                await ledger.settle(made[tenant][-1], tokens_in, tokens_out, gpu_ms, final=action == "settle_final")
        except LedgerError:
            pass  # a closed reservation, usage below what was billed: the log is unchanged


async def _check(ledger: Ledger, clock: FakeClock) -> None:
    events = await ledger.events()
    for tenant in ("a", "b"):
        by_status = (await ledger.usage(tenant, 1.0)).by_status
        for window_s in WINDOWS:
            got = await ledger.usage(tenant, window_s)
            assert got == expected(events, tenant, clock.now_ms - window_s * 1000, window_s, by_status), window_s


@pytest.mark.parametrize("backend", ["sqlite", "postgres", "redis"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(step, min_size=1, max_size=40), start_offset_ms=st.sampled_from([0.0, -0.25, 0.25, 30_000.0]))
def test_usage_equals_the_event_log_summed_over_the_window(
    backend: str, backend_url: Callable[[str], str], steps: list, start_offset_ms: float
) -> None:
    url = backend_url(backend).replace("fgt_", f"fgt_{uuid.uuid4().hex[:6]}_")  # a fresh ledger per example

    async def run() -> None:
        clock = FakeClock(1_700_000_040_000.0 + start_offset_ms)  # 1_700_000_040_000 is a minute boundary
        ledger = await connect(url, QUOTAS, clock)
        try:
            await _play(ledger, clock, steps)
            await _check(ledger, clock)
        finally:
            await drop_ledger(ledger)
            await ledger.close()

    asyncio.run(run())


def test_minutes_are_exact_floors_and_ceilings() -> None:
    for at_ms in (0.0, 59_999.999, 60_000.0, 1_700_000_040_000.0, 1_700_000_039_999.9998, 1_700_000_040_000.0002):
        m = minute_of(at_ms)
        assert m * MINUTE_MS <= at_ms < (m + 1) * MINUTE_MS
        first = first_full_minute(at_ms)
        assert first * MINUTE_MS >= at_ms > (first - 1) * MINUTE_MS


async def test_a_sqlite_ledger_without_minute_totals_gets_them_from_its_events(tmp_path: Path) -> None:
    url, clock = f"sqlite:///{tmp_path}/l.db", FakeClock()
    async with await connect(url, QUOTAS, clock) as ledger:
        for i in range(5):
            r = await ledger.reserve("a", f"r{i}", 10, 10, 5.0)
            await ledger.settle(r.id, 10, 3, 2.5, final=True)
            clock.advance(45.0)
    with sqlite3.connect(tmp_path / "l.db") as raw:  # a ledger made before the totals existed
        raw.execute("DELETE FROM fg_usage_minutes")
    async with await connect(url, QUOTAS, clock) as ledger:
        usage = await ledger.usage("a", 3600.0)
    assert (usage.requests, usage.input_tokens, usage.output_tokens, usage.gpu_ms) == (5, 50, 15, 12.5)


async def test_usage_reads_the_minute_totals_not_every_event_of_the_window(tmp_path: Path) -> None:
    """The cost of a usage read is bounded by the window's minutes, not its events: with every event but those
    of the window's first, partial minute taken out of the log behind the ledger's back, it answers the same
    (a read that summed the window's events, 5.4 s a call at 1M events, would count none of them)."""
    url, clock = f"sqlite:///{tmp_path}/l.db", FakeClock(1_700_000_040_000.0 + 15_000.0)
    async with await connect(url, QUOTAS, clock) as ledger:
        for i in range(40):
            r = await ledger.reserve("a", f"r{i}", 10, 10, 5.0)
            await ledger.settle(r.id, 10, 3, 2.5, final=True)
            clock.advance(20.0)
        window_s = 600.0
        before = await ledger.usage("a", window_s)
        first_full_ms = first_full_minute(clock.now_ms - window_s * 1000) * MINUTE_MS
        with sqlite3.connect(tmp_path / "l.db") as raw:
            gone = raw.execute("DELETE FROM fg_events WHERE at_ms >= ?", (first_full_ms,)).rowcount
        after = await ledger.usage("a", window_s)
    assert gone >= 2 * 25, gone  # most of the window's events (reserve and settlement) are gone from the log
    assert (before.requests, before.output_tokens) == (30, 90), before  # the 30 requests of the last 600 s
    assert after == before, (before, after)
