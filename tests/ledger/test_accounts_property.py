"""A property of the tenant-wide and per-class accounts, on every backend: after any sequence of reserve,
settle, cancel, enqueue, dequeue and expiry over several model classes, no account is over its limits, and
each account holds exactly the slots and queue places of the open reservations charged to it (the
tenant-wide account: all of them; a class with its own table: those of the class), and exactly the spend
they hold and billed at each one's price (no overspend of the spend budget)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fairgate.harness.ledger import drop_ledger
from fairgate.ledger import Ledger, LedgerError, Reservation, Usage, connect, quotas_from_dict
from tests.ledger.conftest import FakeClock, const

QUOTAS = quotas_from_dict(
    {
        "defaults": {
            "requests_per_minute": 600,
            "requests_burst": 50,
            "max_concurrent": 3,
            "max_queued": 2,
            "gpu_seconds": 6,
            "gpu_window_s": 3600,
            "reservation_ttl_s": 60,
            "spend_budget": 6.0,
        },
        "pricing": {  # m2 is unpriced: it costs nothing
            "model_class": {
                "m1": {"input_per_mtok": 150_000.0, "output_per_mtok": 600_000.0, "gpu_per_s": 1.0},
                "large": {"gpu_per_s": 0.75},
                "loose": {"output_per_mtok": 1e6},
            }
        },
        "tenants": {
            "t": {
                "model_class": {
                    "large": {"max_concurrent": 1, "max_queued": 1, "gpu_seconds": 3, "spend_budget": 1.5},
                    "loose": {"max_concurrent": 10, "max_queued": 10},
                }
            }
        },
    }
)
CLASSES = ("m1", "m2", "large", "loose")
ESTIMATES = (0.0, 1000.0, 2500.0)
REQUESTS = 8  # request ids, so that retries (of open and final reservations) happen

step = st.one_of(
    st.tuples(st.just("reserve"), st.integers(0, REQUESTS - 1)),
    st.tuples(st.just("settle"), st.integers(0, REQUESTS - 1), st.booleans()),
    st.tuples(st.just("cancel"), st.integers(0, REQUESTS - 1), st.booleans()),
    st.tuples(st.just("enqueue"), st.integers(0, REQUESTS - 1)),
    st.tuples(st.just("dequeue"), st.integers(0, REQUESTS - 1)),
    st.tuples(st.just("expire"), st.sampled_from([1.0, 61.0])),
)


async def _play_step(ledger: Ledger, clock: FakeClock, ids: dict[int, str], s: tuple) -> None:  # type: ignore[type-arg]
    kind, n = s[0], s[1]
    if kind == "expire":
        clock.advance(n)
        await ledger.expire_due(lambda r: const(False))
        return
    estimate = ESTIMATES[n % len(ESTIMATES)]
    try:
        if kind == "reserve":
            ids[n] = (await ledger.reserve("t", f"r{n}", 1, 1, estimate, model_class=CLASSES[n % len(CLASSES)])).id
        elif n in ids and kind == "settle":
            await ledger.settle(ids[n], 1, 1, estimate / 2, final=s[2])  # within the estimate: no overage
        elif n in ids and kind == "cancel":
            await ledger.cancel(ids[n], Usage() if s[2] else Usage(1, 0, estimate / 4))
        elif n in ids:
            await (ledger.enqueue(ids[n]) if kind == "enqueue" else ledger.dequeue(ids[n]))
    except LedgerError:
        pass  # refused (over a limit, final already): the invariant must hold all the same


def _spend_held_micros(r: Reservation) -> float:
    """What ``r`` holds of the spend budget: its worst case while open, what it billed once final."""
    b = r.billed
    if r.is_final:
        return r.price.spend_micros(b.input_tokens, b.output_tokens, b.gpu_ms)
    return r.price.spend_micros(
        max(r.input_tokens, b.input_tokens), r.max_output_tokens, max(r.gpu_ms_estimate, b.gpu_ms)
    )


async def _check(ledger: Ledger) -> None:
    every = await ledger.reservations("t")
    open_ = [r for r in every if r.status == "open"]
    quota = QUOTAS.tenant("t")
    for r in every:
        assert r.price == QUOTAS.price(r.model_class), r
    for key, limits in (("*", quota.limits), *quota.by_model_class.items()):
        charged = [r for r in open_ if key == "*" or r.model_class == key]
        account = await ledger.account("t", key)
        spent = sum(_spend_held_micros(r) for r in every if key == "*" or r.model_class == key)
        assert account.spend_used_micros == pytest.approx(spent, rel=1e-9, abs=1e-6), key
        assert account.spend_used_micros <= (limits.spend_budget or 0) * 1e6 + 1e-6, key
        assert account.concurrent == len(charged) <= (limits.max_concurrent or 0), key
        assert account.queued == sum(r.queued for r in charged) <= (limits.max_queued or 0), key
        assert account.gpu_window_used_ms <= (limits.gpu_seconds or 0) * 1000.0, key


@pytest.mark.parametrize("backend", ["sqlite", "postgres", "redis"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(step, min_size=1, max_size=40))
def test_no_account_is_ever_over_its_limits(backend: str, backend_url: Callable[[str], str], steps: list) -> None:  # type: ignore[type-arg]
    url = backend_url(backend).replace("fgt_", f"fgt_{uuid.uuid4().hex[:6]}_")  # a fresh ledger per example

    async def run() -> None:
        clock = FakeClock()
        ledger = await connect(url, QUOTAS, clock)
        ids: dict[int, str] = {}
        try:
            for s in steps:
                await _play_step(ledger, clock, ids, s)
                await _check(ledger)
        finally:
            await drop_ledger(ledger)
            await ledger.close()

    asyncio.run(run())
