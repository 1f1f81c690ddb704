"""One conformance suite, run against every backend (SQLite file, PostgreSQL, Redis): the ledger's semantics."""

from __future__ import annotations

import asyncio

import pytest

from fairgate.ledger import (
    IdempotencyConflict,
    InvalidUsage,
    Ledger,
    QuotaExceeded,
    ReservationFinal,
    ReservationNotFound,
    SettlementFrozen,
    UnknownTenant,
    Usage,
    quotas_from_dict,
)
from fairgate.ledger.reconcile import reconcile
from fairgate.ledger.rules import MAX_TOKENS_PER_CALL
from tests.ledger.conftest import LIMITS, const

QUOTAS = {
    "defaults": {**LIMITS, "gpu_seconds_total": 25, "max_model_calls": 3, "max_tool_rounds": 1, "max_tokens": 2500},
    "tenants": {"a": {}, "b": {}, "big": {"model_class": {"large": {"max_concurrent": 1}}}},
}


@pytest.fixture
async def ledger(open_ledger, clock):  # type: ignore[no-untyped-def]
    return await open_ledger(QUOTAS, clock)


async def serve_one(ledger: Ledger, tenant: str, request_id: str, gpu_ms: float = 0.0) -> None:
    """One request of a token in and a token out, reserved and at once settled with ``gpu_ms``."""
    r = await ledger.reserve(tenant, request_id, 1, 1, gpu_ms)
    await ledger.settle(r.id, 1, 1, gpu_ms, final=True)


async def test_reserve_settle_releases_the_remainder(ledger, clock):
    r = await ledger.reserve("a", "r1", 1000, 1500, 2000.0)
    assert (r.status, r.input_tokens, r.max_output_tokens, r.gpu_ms_estimate) == ("open", 1000, 1500, 2000.0)
    assert r.expires_at_ms == clock.now_ms + 60_000
    # 1,500 output tokens held: 600 more do not fit the 2,000 burst...
    with pytest.raises(QuotaExceeded) as excinfo:
        await ledger.reserve("a", "r2", 10, 600, 0.0)
    assert excinfo.value.dimension == "output_tokens_per_minute" and excinfo.value.retry_after_s > 0
    # ...until the final settlement returns what was not generated.
    await ledger.settle(r.id, 1000, 30, 500.0)  # partial: still held
    with pytest.raises(QuotaExceeded):
        await ledger.reserve("a", "r2", 10, 600, 0.0)
    done = await ledger.settle(r.id, 1000, 40, 900.0, final=True)
    assert done.status == "settled" and done.billed == Usage(1000, 40, 900.0) and done.final_ms == clock.now_ms
    assert (await ledger.reserve("a", "r2", 10, 600, 0.0)).status == "open"


async def test_same_request_id_is_deducted_once(ledger):
    first = await ledger.reserve("a", "same", 10, 10, 1.0)
    again = await ledger.reserve("a", "same", 10, 10, 1.0)
    assert again == first
    await ledger.reserve("a", "x", 10, 10, 1.0)
    await ledger.reserve("a", "y", 10, 10, 1.0)  # 3 concurrent: "same" counted once
    with pytest.raises(QuotaExceeded, match="max_concurrent"):
        await ledger.reserve("a", "z", 10, 10, 1.0)
    assert [e.kind for e in await ledger.events("a")].count("reserve") == 3
    # Settled, the retry still returns the original (final) result and deducts nothing.
    await ledger.settle(first.id, 10, 5, 1.0, final=True)
    assert (await ledger.reserve("a", "same", 10, 10, 1.0)).status == "settled"


async def test_same_request_id_other_arguments_conflicts(ledger):
    await ledger.reserve("a", "r", 10, 10, 1.0)
    with pytest.raises(IdempotencyConflict):
        await ledger.reserve("a", "r", 10, 11, 1.0)
    # Request ids are per tenant: another tenant may use the same one.
    assert (await ledger.reserve("b", "r", 10, 11, 1.0)).tenant == "b"


async def test_concurrent_reserves_on_one_balance_never_overshoot(ledger):
    results = await asyncio.gather(
        *(ledger.reserve("a", f"c{i}", 1, 1, 0.0) for i in range(20)), return_exceptions=True
    )
    admitted = [r for r in results if not isinstance(r, Exception)]
    rejected = [r for r in results if isinstance(r, QuotaExceeded)]
    assert len(admitted) == 3 and len(rejected) == 17


async def test_final_settle_once_repeats_return_the_same(ledger):
    r = await ledger.reserve("a", "r", 100, 100, 100.0)
    first = await ledger.settle(r.id, 100, 50, 80.0, final=True)
    assert await ledger.settle(r.id, 100, 50, 80.0, final=True) == first
    with pytest.raises(ReservationFinal):
        await ledger.settle(r.id, 100, 60, 80.0, final=True)
    with pytest.raises(ReservationFinal):
        await ledger.settle(r.id, 100, 60, 80.0)
    with pytest.raises(ReservationFinal):
        await ledger.cancel(r.id, Usage(100, 50, 80.0))
    usage = await ledger.usage("a", 3600)
    assert (usage.input_tokens, usage.output_tokens, usage.gpu_ms) == (100, 50, 80.0)  # counted once


async def test_repeated_partial_settlement_changes_nothing(ledger):
    r = await ledger.reserve("a", "r", 100, 100, 100.0)
    await ledger.settle(r.id, 100, 20, 30.0)
    await ledger.settle(r.id, 100, 20, 30.0)
    assert [e.kind for e in await ledger.events("a")] == ["reserve", "settle"]
    with pytest.raises(InvalidUsage, match="cumulative"):
        await ledger.settle(r.id, 100, 10, 30.0)


async def test_gpu_overage_is_booked_not_dropped(ledger):
    r = await ledger.reserve("a", "r", 10, 10, 1000.0)
    done = await ledger.settle(r.id, 10, 10, 9500.0, final=True)
    assert done.overage_gpu_ms == 8500.0
    assert (await ledger.usage("a", 3600)).overage_gpu_ms == 8500.0
    # 9.5 s of the 10 s window are used: a 1 s estimate no longer fits, and says when the window ends.
    with pytest.raises(QuotaExceeded) as excinfo:
        await ledger.reserve("a", "r2", 10, 10, 1000.0)
    assert excinfo.value.dimension == "gpu_seconds" and 0 < excinfo.value.retry_after_s <= 3600
    # Overage mid-stream is booked at once, before the final settlement.
    r3 = await ledger.reserve("b", "r3", 10, 10, 100.0)
    await ledger.settle(r3.id, 10, 5, 9950.0)
    with pytest.raises(QuotaExceeded, match="gpu_seconds"):
        await ledger.reserve("b", "r4", 10, 10, 100.0)


async def test_gpu_window_resets_but_total_budget_does_not(ledger, clock):
    for i in range(2):
        await serve_one(ledger, "a", f"w{i}", 9000.0)
        clock.advance(3600)
    await serve_one(ledger, "a", "w2", 6000.0)  # 18 s + 6 s <= 25 s total
    clock.advance(3600)
    with pytest.raises(QuotaExceeded) as excinfo:
        await ledger.reserve("a", "w3", 1, 1, 2000.0)
    assert excinfo.value.dimension == "gpu_seconds_total" and excinfo.value.retry_after_s is None


async def test_cancel_bills_what_was_consumed_and_frees_the_slot(ledger, clock):
    reservations = [await ledger.reserve("a", f"k{i}", 100, 500, 300.0) for i in range(3)]
    for i, r in enumerate(reservations):
        cancelled = await ledger.cancel(r.id, Usage(100, 7 * i, 20.0))
        assert cancelled.status == "cancelled" and cancelled.billed == Usage(100, 7 * i, 20.0)
    # The slots came back (a counter that only goes up when clients cancel would refuse these).
    clock.advance(5)  # (and the request bucket refills)
    for i in range(3):
        await ledger.reserve("a", f"again{i}", 1, 1, 0.0)
    usage = await ledger.usage("a", 3600)
    assert (usage.input_tokens, usage.output_tokens) == (300, 21)  # input tokens are billed too
    assert usage.by_status == {"cancelled": 3, "open": 3}


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda L, rid: L.settle(rid, 10, 101, 1.0), "above the reservation"),
        (lambda L, rid: L.settle(rid, -1, 1, 1.0), "input_tokens"),
        (lambda L, rid: L.settle(rid, 1.5, 1, 1.0), "input_tokens"),
        (lambda L, rid: L.settle(rid, 1, 1, -3.0), "gpu_ms"),
        (lambda L, rid: L.settle(rid, 1, 1, float("nan")), "gpu_ms"),
        (lambda L, rid: L.cancel(rid, Usage(1, -2, 0.0)), "output_tokens"),
    ],
)
async def test_bad_amounts_change_nothing(ledger, call, match):
    r = await ledger.reserve("a", "r", 10, 100, 1.0)
    with pytest.raises(InvalidUsage, match=match):
        await call(ledger, r.id)
    assert await ledger.get(r.id) == r
    assert len(await ledger.events()) == 1


@pytest.mark.parametrize(
    "args, match",
    [
        ((-1, 10, 1.0), "input_tokens"),
        ((1, "10", 1.0), "output_tokens"),
        ((1, 10, -1.0), "gpu_ms"),
        ((True, 10, 1.0), "input_tokens"),
    ],
)
async def test_bad_reserve_changes_nothing(ledger, args, match):
    with pytest.raises(InvalidUsage, match=match):
        await ledger.reserve("a", "r", *args)
    assert await ledger.events() == [] and await ledger.reservations() == []


async def test_unknown_reservation_and_tenant(ledger):
    with pytest.raises(ReservationNotFound):
        await ledger.settle("ca978112ca1bbdca-00000000000000000000000000000000", 1, 1, 1.0)
    with pytest.raises(ReservationNotFound):
        await ledger.get("nope")
    with pytest.raises(UnknownTenant):
        await ledger.reserve("mallory", "r", 1, 1, 0.0)


async def test_bucket_burst_is_capped_after_idle_time(ledger, clock):
    clock.advance(30 * 86_400)  # a month idle banks no more than the burst of 5 requests
    for i in range(5):
        await serve_one(ledger, "b", f"b{i}")
    with pytest.raises(QuotaExceeded) as excinfo:
        await ledger.reserve("b", "b5", 1, 1, 0.0)
    assert excinfo.value.dimension == "requests_per_minute"
    assert excinfo.value.retry_after_s == pytest.approx(1.0, abs=0.01)  # 60/min: one a second
    clock.advance(1.0)
    await ledger.reserve("b", "b5", 1, 1, 0.0)


async def test_clock_running_backwards_grants_nothing(ledger, clock):
    for i in range(5):
        await serve_one(ledger, "a", f"t{i}")
    clock.advance(-120.0)  # another process's clock, two minutes behind
    with pytest.raises(QuotaExceeded, match="requests_per_minute"):
        await ledger.reserve("a", "t5", 1, 1, 0.0)
    clock.advance(120.0 + 1.0)
    await ledger.reserve("a", "t5", 1, 1, 0.0)


async def test_agent_run_limits(ledger):
    r1 = await ledger.reserve("a", "m1", 100, 400, 0.0, run_id="run-1")
    await ledger.settle(r1.id, 100, 50, 0.0, final=True)  # the run holds 150 tokens, not 500
    await ledger.reserve("a", "m2", 100, 400, 0.0, run_id="run-1", tool_round=True)
    with pytest.raises(QuotaExceeded, match="max_tool_rounds"):
        await ledger.reserve("a", "m3", 100, 400, 0.0, run_id="run-1", tool_round=True)
    with pytest.raises(QuotaExceeded, match="max_tokens"):
        await ledger.reserve("a", "m3", 500, 1500, 0.0, run_id="run-1")
    await ledger.reserve("a", "m3", 100, 100, 0.0, run_id="run-1")
    with pytest.raises(QuotaExceeded, match="max_model_calls"):
        await ledger.reserve("a", "m4", 1, 1, 0.0, run_id="run-1")
    await ledger.reserve("a", "m4", 1, 1, 0.0, run_id="run-2")  # another run has its own counters


async def test_limits_per_model_class(ledger):
    await ledger.reserve("big", "l1", 1, 1, 0.0, model_class="large")
    with pytest.raises(QuotaExceeded, match="max_concurrent"):
        await ledger.reserve("big", "l2", 1, 1, 0.0, model_class="large")
    await ledger.reserve("big", "s1", 1, 1, 0.0)  # the default class has its own balance


async def test_expiry_waits_for_the_execution_registry(ledger, clock):
    running = await ledger.reserve("a", "long", 100, 100, 10.0)
    dead = await ledger.reserve("a", "dead", 100, 100, 10.0)
    await ledger.settle(dead.id, 100, 5, 4.0)
    clock.advance(59)
    assert await ledger.expire_due(lambda r: const(False)) == []  # not due yet
    clock.advance(2)
    alive = {running.id}
    expired = await ledger.expire_due(lambda r: const(r.id in alive))
    assert [r.id for r in expired] == [dead.id]
    assert expired[0].status == "expired" and expired[0].billed == Usage(100, 5, 4.0)
    extended = await ledger.get(running.id)
    assert extended.status == "open" and extended.expires_at_ms == clock.now_ms + 60_000
    alive.clear()
    clock.advance(61)
    assert [r.id for r in await ledger.expire_due(lambda r: const(False))] == [running.id]
    assert (await ledger.usage("a", 3600)).open_reservations == 0


async def test_a_tenant_no_longer_configured_is_expired_and_stops_no_other_expiry(ledger, clock):
    """A process that does not know a tenant (removed by a restart, or another process's new one while a
    reload reaches every process) still sweeps: it expired nothing at all, for any tenant, before."""
    gone = await ledger.reserve("big", "g1", 10, 10, 5.0, model_class="large")
    kept = await ledger.reserve("a", "k1", 10, 10, 5.0)
    ledger.apply_quotas(quotas_from_dict({**QUOTAS, "tenants": {"a": {}, "b": {}}}))
    clock.advance(61)  # both TTLs (60 s, as reserved) are over
    expired = await ledger.expire_due(lambda r: const(False))
    assert sorted((r.id, r.status) for r in expired) == sorted([(gone.id, "expired"), (kept.id, "expired")])
    assert (await ledger.usage("big", 3600)).open_reservations == 0
    assert (await ledger.account("big")).concurrent == 0  # its tenant-wide slot is released
    with pytest.raises(UnknownTenant):
        await ledger.reserve("big", "g2", 1, 1, 0.0)


async def test_default_registry_is_the_heartbeat(ledger, clock):
    r = await ledger.reserve("a", "hb", 1, 1, 0.0)
    clock.advance(50)
    await ledger.heartbeat(r.id)
    beat_ms = clock.now_ms
    clock.advance(20)
    assert await ledger.expire_due() == []  # beat 20 s ago, within the TTL: extended ...
    assert (await ledger.get(r.id)).expires_at_ms == pytest.approx(beat_ms + 60_000)  # ... to a TTL after the beat
    clock.advance(39)
    assert await ledger.expire_due() == []
    clock.advance(2)  # a TTL and a second after the last heartbeat (a dead process): the next sweep ends it
    assert [x.id for x in await ledger.expire_due()] == [r.id]


async def test_one_process_holds_a_run_claim_until_its_lease_lapses(ledger, clock):
    r = await ledger.reserve("a", "claimed", 1, 1, 0.0)
    taken = await ledger.claim(r.id, "gw-1", 30_000.0)
    assert taken.held_by("gw-1") and taken.remaining_ms == pytest.approx(30_000.0)
    clock.advance(10)
    refused = await ledger.claim(r.id, "gw-2", 30_000.0)  # the same request id, another process
    assert not refused.held_by("gw-2") and refused.owner == "gw-1"
    assert refused.remaining_ms == pytest.approx(20_000.0)
    renewed = await ledger.claim(r.id, "gw-1", 30_000.0)  # the holder's sweep renews it
    assert renewed.held_by("gw-1") and renewed.remaining_ms == pytest.approx(30_000.0)
    clock.advance(29)
    assert (await ledger.claim(r.id, "gw-2", 30_000.0)).owner == "gw-1"
    clock.advance(2)  # the holder missed its renewals (it died): the request is free for another process
    assert (await ledger.claim(r.id, "gw-2", 30_000.0)).held_by("gw-2")
    assert (await ledger.claim(r.id, "gw-1", 30_000.0)).owner == "gw-2"


async def test_a_run_claim_heartbeats_and_ends_with_its_reservation(ledger, clock):
    r = await ledger.reserve("a", "claim-beat", 1, 1, 0.0)
    clock.advance(50)
    await ledger.claim(r.id, "gw-1", 30_000.0)
    clock.advance(20)
    assert await ledger.expire_due() == []  # the claim beat 20 s ago, within the 60 s TTL
    await ledger.settle(r.id, 1, 1, 0.0, final=True)
    with pytest.raises(ReservationFinal):
        await ledger.claim(r.id, "gw-2", 30_000.0)
    with pytest.raises(ReservationNotFound):
        await ledger.claim("0123456789abcdef-" + "0" * 32, "gw-1", 30_000.0)


async def test_concurrent_claims_leave_exactly_one_holder(ledger):
    r = await ledger.reserve("a", "raced", 1, 1, 0.0)
    claims = await asyncio.gather(*(ledger.claim(r.id, f"gw-{i}", 30_000.0) for i in range(8)))
    winners = [f"gw-{i}" for i, c in enumerate(claims) if c.held_by(f"gw-{i}")]
    assert len(winners) == 1 and {c.owner for c in claims} == set(winners), claims


@pytest.mark.parametrize(
    ("owner", "lease_ms", "match"),
    [
        ("", 1000.0, "owner"),
        ("gw\n1", 1000.0, "owner"),
        (None, 1000.0, "owner"),
        ("gw", 0.0, "lease_ms"),
        ("gw", float("nan"), "lease_ms"),
        ("gw", True, "lease_ms"),
        ("gw", 1e12, "lease_ms"),
    ],
)
async def test_bad_claims_take_nothing(ledger, owner, lease_ms, match):
    r = await ledger.reserve("a", "bad-claim", 1, 1, 0.0)
    with pytest.raises(InvalidUsage, match=match):
        await ledger.claim(r.id, owner, lease_ms)
    assert (await ledger.claim(r.id, "gw-1", 1000.0)).held_by("gw-1")


async def test_frozen_tenant_cannot_settle_automatically(ledger, clock):
    r = await ledger.reserve("a", "f", 1, 10, 0.0)
    await ledger.freeze("a", "reservations and events differ by 12 tokens")
    assert await ledger.frozen() == {"a": "reservations and events differ by 12 tokens"}
    with pytest.raises(SettlementFrozen):
        await ledger.settle(r.id, 1, 5, 0.0, final=True)
    clock.advance(3600)
    assert await ledger.expire_due(lambda r: const(False)) == []  # frozen: left for the operator
    await ledger.unfreeze("a")
    assert (await ledger.settle(r.id, 1, 5, 0.0, final=True)).status == "settled"


async def test_usage_is_per_tenant_and_matches_the_event_log(ledger, clock):
    ra = await ledger.reserve("a", "u", 10, 20, 5.0)
    rb = await ledger.reserve("b", "u", 30, 40, 7.0)
    await ledger.settle(ra.id, 10, 20, 5.0, final=True)
    await ledger.settle(rb.id, 30, 33, 7.0, final=True)
    a, b = await ledger.usage("a", 60), await ledger.usage("b", 60)
    assert (a.requests, a.input_tokens, a.output_tokens, a.gpu_ms) == (1, 10, 20, 5.0)
    assert (b.requests, b.input_tokens, b.output_tokens, b.gpu_ms) == (1, 30, 33, 7.0)
    events = await ledger.events()
    assert sum(e.output_tokens for e in events) == 53
    clock.advance(120)
    assert (await ledger.usage("a", 60)).requests == 0  # outside the window


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"input_tokens": 10_000_001}, "input_tokens"),
        ({"max_output_tokens": 2**63}, "output_tokens"),
        ({"gpu_ms_estimate": 1.7e308}, "gpu_ms"),
        ({"model_class": None}, "model_class"),
        ({"model_class": 7}, "model_class"),
        ({"model_class": "a\x00b"}, "model_class"),
        ({"model_class": "x" * 201}, "model_class"),
        ({"run_id": 123}, "run_id"),
        ({"run_id": "\ud800"}, "run_id"),
        ({"request_id": "r\x00"}, "request_id"),
        ({"tool_round": "no"}, "tool_round"),
    ],
)
async def test_bad_names_and_huge_amounts_change_nothing(ledger, kwargs, match):
    args = {
        "tenant": "a",
        "request_id": "r",
        "input_tokens": 1,
        "max_output_tokens": 1,
        "gpu_ms_estimate": 0.0,
    } | kwargs
    with pytest.raises(InvalidUsage, match=match):
        await ledger.reserve(**args)
    assert await ledger.events() == [] and await ledger.reservations() == []


async def test_input_above_the_reservation_is_billed_as_read_and_flagged(ledger):
    """What the engine read is what the tenant used: a settlement's input far above the estimate is billed in
    full (never refused, which left the reservation to expire billing nothing) and flagged by reconcile; a
    figure past the ledger's bounds on one call is still refused."""
    r = await ledger.reserve("a", "r", 10, 10, 1.0)
    with pytest.raises(InvalidUsage, match="gpu_ms"):
        await ledger.settle(r.id, 10, 5, 1.7e308, final=True)
    with pytest.raises(InvalidUsage, match="input_tokens"):
        await ledger.settle(r.id, MAX_TOKENS_PER_CALL + 1, 5, 1.0, final=True)
    near = await ledger.reserve("a", "near", 10, 10, 1.0)
    assert (await ledger.settle(near.id, 1044, 5, 1.0, final=True)).billed.input_tokens == 1044  # 2 x 10 + 1,024
    assert (await ledger.settle(r.id, 150_038, 5, 1.0, final=True)).billed.input_tokens == 150_038
    assert sum(e.input_tokens for e in await ledger.events("a")) == 151_082
    [row] = (await reconcile(ledger, freeze=False)).tenants
    assert row.differences == [] and row.input_above_reservation == {"count": 1, "request_ids": ["r"]}, row


async def test_bad_query_arguments(ledger):
    with pytest.raises(InvalidUsage, match="window_s"):
        await ledger.usage("a", True)
    with pytest.raises(InvalidUsage, match="status"):
        await ledger.reservations(status="done")
    with pytest.raises(InvalidUsage, match="tenant"):
        await ledger.usage(["a"], 60)


async def test_shared_charge_totals_add_up_across_callers(ledger):
    assert await ledger.add_charges("emu", {}) == {}
    assert await ledger.add_charges("emu", {"a": (12.5, 400, 3)}) == {"a": (12.5, 400, 3)}
    # Two gateway processes add at once: nothing is lost, each sees both.
    first, second = await asyncio.gather(
        ledger.add_charges("emu", {"a": (0.25, 0, 1), "b": (7.0, 10, 2)}), ledger.add_charges("emu", {"b": (3.0, 5, 1)})
    )
    final = await ledger.add_charges("emu", {})
    assert final == {"a": (12.75, 400, 4), "b": (10.0, 15, 3)}
    assert final in (first, second)
    assert await ledger.add_charges("other-model", {"a": (1.0, 1, 1)}) == {"a": (1.0, 1, 1)}  # scopes apart


@pytest.mark.parametrize(
    "deltas",
    [
        {"b": (1.0, 1, 1), "a": (float("nan"), 2, 3)},
        {"b": (1.0, 1, 1), "a": (-1.0, 0, 0)},
        {"b": (1.0, 1, 1), "a": (1.0, -2, 0)},
        {"b": (1.0, 1, 1), "a": (1.0, 0, 2.5)},
        {"b": (1.0, 1, 1), "a": (1.0, 0)},
        {"b": (1.0, 1, 1), "": (1.0, 0, 0)},
        [("a", (1.0, 0, 0))],
    ],
)
async def test_bad_charges_add_nothing(ledger, deltas):
    await ledger.add_charges("emu", {"a": (1.0, 2, 3)})
    with pytest.raises(InvalidUsage):
        await ledger.add_charges("emu", deltas)
    assert await ledger.add_charges("emu", {}) == {"a": (1.0, 2, 3)}  # not even the valid entries


async def test_each_process_sees_the_occupancy_the_other_processes_published_until_it_goes_stale(open_ledger):
    ledger = await open_ledger(QUOTAS)  # the real clock: staleness is the ledger's (Redis expires keys itself)
    u1, u2 = "http://127.0.0.1:1/v1", "http://127.0.0.1:2/v1"
    assert await ledger.share_occupancy("p1", {u1: (3.0, 0.125), u2: (1.0, 0.0)}, 60_000.0) == {}
    assert await ledger.share_occupancy("p2", {u1: (2.0, 0.5)}, 60_000.0) == {u1: (3.0, 0.125), u2: (1.0, 0.0)}
    assert await ledger.share_occupancy("p3", {}, 60_000.0) == {u1: (5.0, 0.625), u2: (1.0, 0.0)}
    # p1's new round replaces its old one (u2 gone), and the others are summed.
    assert await ledger.share_occupancy("p1", {u1: (0.5, 0.0)}, 60_000.0) == {u1: (2.0, 0.5)}
    assert await ledger.share_occupancy("p3", {}, 60_000.0) == {u1: (2.5, 0.5)}
    # What a process published counts for stale_after_ms: one that stops publishing drops out.
    assert await ledger.share_occupancy("p1", {u1: (1.0, 0.0)}, 300.0) == {u1: (2.0, 0.5)}
    assert await ledger.share_occupancy("p2", {u1: (4.0, 0.0)}, 300.0) == {u1: (1.0, 0.0)}
    await ledger.share_occupancy("p3", {}, 300.0)
    await asyncio.sleep(0.5)
    assert await ledger.share_occupancy("p1", {u1: (1.0, 0.0)}, 300.0) == {}
    assert await ledger.share_occupancy("p3", {}, 300.0) == {u1: (1.0, 0.0)}


async def test_occupancy_goes_stale_on_the_ledger_clock(open_ledger, clock):  # type: ignore[no-untyped-def]
    ledger = await open_ledger(QUOTAS, clock)  # an injected clock: staleness follows it, not the server's
    u1 = "http://127.0.0.1:1"
    await ledger.share_occupancy("p1", {u1: (2.0, 0.25)}, 1000.0)
    clock.advance(0.5)
    assert await ledger.share_occupancy("p2", {}, 1000.0) == {u1: (2.0, 0.25)}
    clock.advance(1.0)  # p1 wrote 1.5 s ago on the ledger clock
    assert await ledger.share_occupancy("p2", {}, 1000.0) == {}


QUEUE_QUOTAS = {
    "defaults": {"max_queued": 2, "max_concurrent": 10, "reservation_ttl_s": 60},
    "tenants": {"a": {}, "b": {}},
}


async def test_queue_places_are_taken_by_waiting_requests_only_and_always_given_back(open_ledger, clock):
    ledger = await open_ledger(QUEUE_QUOTAS, clock)
    r = [await ledger.reserve("a", f"q{i}", 1, 10, 0.0) for i in range(5)]
    assert (await ledger.account("a")).queued == 0  # dispatched at once: no place taken
    assert (await ledger.enqueue(r[0].id)).queued
    await ledger.enqueue(r[0].id)  # idempotent
    await ledger.enqueue(r[1].id)
    assert (await ledger.account("a")).queued == 2
    with pytest.raises(QuotaExceeded) as refused:
        await ledger.enqueue(r[2].id)
    assert (refused.value.dimension, refused.value.limit) == ("max_queued", 2)
    assert not (await ledger.get(r[2].id)).queued
    await ledger.enqueue((await ledger.reserve("b", "q0", 1, 10, 0.0)).id)  # per tenant
    # A place comes back when the request gets its slot, or at its final settlement if it never did.
    assert not (await ledger.dequeue(r[0].id)).queued
    await ledger.dequeue(r[0].id)  # idempotent
    await ledger.enqueue(r[2].id)
    await ledger.cancel(r[1].id, Usage())
    assert (await ledger.account("a")).queued == 1
    await ledger.settle(r[2].id, 1, 3, 0.0, final=True)
    assert (await ledger.account("a")).queued == 0
    await ledger.dequeue(r[2].id)  # after the final settlement: nothing to give back twice
    assert (await ledger.account("a")).queued == 0
    assert not (await ledger.enqueue(r[2].id)).queued  # a final reservation takes no place
    # An expired queued request gives its place back too.
    await ledger.enqueue(r[3].id)
    clock.advance(61)
    await ledger.expire_due(lambda _r: const(False))
    assert (await ledger.account("a")).queued == 0
    with pytest.raises(ReservationNotFound):
        await ledger.enqueue("nope")


async def test_concurrent_enqueues_never_exceed_the_queue_bound(open_ledger, clock):
    ledger = await open_ledger(QUEUE_QUOTAS, clock)
    reservations = [await ledger.reserve("a", f"c{i}", 1, 10, 0.0) for i in range(8)]
    outcomes = await asyncio.gather(*(ledger.enqueue(r.id) for r in reservations), return_exceptions=True)
    assert sum(not isinstance(o, BaseException) for o in outcomes) == 2
    assert all(isinstance(o, QuotaExceeded) for o in outcomes if isinstance(o, BaseException))
    assert (await ledger.account("a")).queued == 2


# Tenant limits hold across model classes; a class's own table caps inside them (issue 12, item 4).
ACROSS_QUOTAS = {
    "defaults": {
        "requests_per_minute": 60,
        "requests_burst": 5,
        "max_concurrent": 3,
        "max_queued": 2,
        "gpu_seconds": 10,
        "gpu_window_s": 3600,
        "reservation_ttl_s": 60,
    },
    "tenants": {
        "plain": {},
        "split": {"model_class": {"large": {"max_concurrent": 1, "gpu_seconds": 4}, "loose": {"max_concurrent": 10}}},
        "other": {},
    },
}


@pytest.fixture
async def across(open_ledger, clock):  # type: ignore[no-untyped-def]
    return await open_ledger(ACROSS_QUOTAS, clock)


async def test_classes_without_tables_share_the_tenant_limits(across):
    await across.reserve("plain", "m1", 1, 1, 0.0, model_class="model-a")
    await across.reserve("plain", "m2", 1, 1, 0.0, model_class="model-b")
    await across.reserve("plain", "m3", 1, 1, 0.0, model_class="model-a")
    for model_class in ("model-a", "model-b", "model-c"):
        with pytest.raises(QuotaExceeded) as refused:
            await across.reserve("plain", f"4th-{model_class}", 1, 1, 0.0, model_class=model_class)
        assert (refused.value.dimension, refused.value.limit) == ("max_concurrent", 3)
    # One account holds them all, whichever class it is asked for.
    for model_class in ("model-a", "model-b", "*"):
        assert (await across.account("plain", model_class)).concurrent == 3
    assert (await across.reserve("other", "m1", 1, 1, 0.0, model_class="model-a")).status == "open"  # per tenant


async def test_the_request_buckets_are_shared_across_classes(across):
    for i in range(5):
        r = await across.reserve("plain", f"b{i}", 1, 1, 0.0, model_class=f"model-{i % 2}")
        await across.settle(r.id, 1, 1, 0.0, final=True)
    with pytest.raises(QuotaExceeded) as refused:
        await across.reserve("plain", "b5", 1, 1, 0.0, model_class="model-9")
    assert refused.value.dimension == "requests_per_minute"


async def test_a_class_table_caps_inside_the_tenant_limits(across):
    await across.reserve("split", "l1", 1, 1, 0.0, model_class="large")
    with pytest.raises(QuotaExceeded) as refused:
        await across.reserve("split", "l2", 1, 1, 0.0, model_class="large")
    assert (refused.value.dimension, refused.value.limit) == ("max_concurrent", 1)
    await across.reserve("split", "s1", 1, 1, 0.0, model_class="small")
    await across.reserve("split", "s2", 1, 1, 0.0, model_class="loose")
    # The tenant's 3 slots are taken (one by "large"): a class allowing 10 gets none.
    with pytest.raises(QuotaExceeded) as refused:
        await across.reserve("split", "s3", 1, 1, 0.0, model_class="loose")
    assert (refused.value.dimension, refused.value.limit) == ("max_concurrent", 3)
    assert (await across.account("split", "large")).concurrent == 1  # the class's own account
    assert (await across.account("split", "loose")).concurrent == 1
    assert (await across.account("split", "small")).concurrent == 3  # no table: the tenant-wide account
    assert (await across.account("split", "*")).concurrent == 3


async def test_settle_cancel_and_expiry_give_back_to_every_account_charged(across, clock):
    large = await across.reserve("split", "l1", 1, 1, 0.0, model_class="large")
    await across.reserve("split", "s1", 1, 1, 0.0, model_class="small")
    await across.reserve("split", "s2", 1, 1, 0.0, model_class="small")
    with pytest.raises(QuotaExceeded):
        await across.reserve("split", "s3", 1, 1, 0.0, model_class="small")
    await across.cancel(large.id, Usage())
    assert [(await across.account("split", c)).concurrent for c in ("large", "*")] == [0, 2]
    large = await across.reserve("split", "l2", 1, 1, 0.0, model_class="large")  # both slots came back
    await across.settle(large.id, 1, 1, 0.0, final=True)
    assert [(await across.account("split", c)).concurrent for c in ("large", "*")] == [0, 2]
    large = await across.reserve("split", "l3", 1, 1, 0.0, model_class="large")
    clock.advance(61)
    expired = await across.expire_due(lambda r: const(False))
    assert {r.request_id for r in expired} == {"s1", "s2", "l3"}
    assert [(await across.account("split", c)).concurrent for c in ("large", "*")] == [0, 0]
    assert (await across.reserve("split", "l4", 1, 1, 0.0, model_class="large")).status == "open"


async def test_the_gpu_budget_is_shared_and_a_class_budget_caps_inside_it(across):
    r = await across.reserve("split", "g1", 1, 1, 3000.0, model_class="large")
    await across.settle(r.id, 1, 1, 3500.0, final=True)
    with pytest.raises(QuotaExceeded) as refused:  # the class's 4 s
        await across.reserve("split", "g2", 1, 1, 1000.0, model_class="large")
    assert (refused.value.dimension, refused.value.limit) == ("gpu_seconds", 4)
    s = await across.reserve("split", "g3", 1, 1, 6000.0, model_class="small")
    await across.settle(s.id, 1, 1, 6000.0, final=True)
    # 9.5 s of the tenant's 10 s are spent across the classes: 1 s fits in no class.
    for model_class in ("small", "large", "loose"):
        with pytest.raises(QuotaExceeded) as refused:
            await across.reserve("split", f"g4-{model_class}", 1, 1, 1000.0, model_class=model_class)
        assert refused.value.dimension == "gpu_seconds"
    assert (await across.account("split", "*")).gpu_window_used_ms == 9500.0
    assert (await across.account("split", "large")).gpu_window_used_ms == 3500.0


async def test_queue_places_are_tenant_wide(across):
    rs = [await across.reserve("plain", f"q{i}", 1, 1, 0.0, model_class=f"model-{i}") for i in range(3)]
    await across.enqueue(rs[0].id)
    await across.enqueue(rs[1].id)
    with pytest.raises(QuotaExceeded) as refused:
        await across.enqueue(rs[2].id)
    assert (refused.value.dimension, refused.value.limit) == ("max_queued", 2)
    await across.dequeue(rs[0].id)
    assert (await across.enqueue(rs[2].id)).queued
    await across.cancel(rs[1].id, Usage())
    assert (await across.account("plain", "model-7")).queued == 1


# A reservation cancelled before it ran may be retried with its request id (issue 12, item 9).
async def test_a_retry_reopens_a_reservation_cancelled_with_nothing_billed(ledger, clock):
    first = await ledger.reserve("a", "queued", 10, 20, 5.0)
    await ledger.claim(first.id, "gw-1", 30_000.0)
    await ledger.enqueue(first.id)
    await ledger.cancel(first.id, Usage())  # the client hung up while it waited for a slot
    clock.advance(5)
    again = await ledger.reserve("a", "queued", 10, 20, 5.0)
    assert (again.id, again.status, again.billed, again.queued) == (first.id, "open", Usage(), False)
    assert (again.expires_at_ms, again.final_ms) == (clock.now_ms + 60_000, None)
    assert await ledger.get(first.id) == again
    assert (await ledger.account("a")).concurrent == 1  # charged again
    assert [e.kind for e in await ledger.events("a")] == ["reserve", "cancel", "reserve"]
    assert (await ledger.usage("a", 3600)).by_status == {"open": 1}
    assert (await ledger.claim(again.id, "gw-2", 30_000.0)).held_by("gw-2")  # the old run claim went with it
    assert await ledger.reserve("a", "queued", 10, 20, 5.0) == again  # open: returned as it is
    done = await ledger.settle(again.id, 10, 20, 5.0, final=True)
    assert (await ledger.usage("a", 3600)).output_tokens == 20
    assert await ledger.reserve("a", "queued", 10, 20, 5.0) == done  # billed: final for good


async def test_a_reopen_is_not_counted_as_another_request(ledger):
    """The request bucket (burst 5) and the run's model calls (3) count an id once, however often it is
    cancelled before it ran and re-opened; its tokens are charged again (the cancel gave them back)."""
    first = await ledger.reserve("a", "again", 10, 20, 5.0, run_id="run-1")
    for _ in range(6):
        await ledger.cancel(first.id, Usage())
        again = await ledger.reserve("a", "again", 10, 20, 5.0, run_id="run-1")
        assert (again.id, again.status) == (first.id, "open")
    account = await ledger.account("a")
    assert account.requests_level == pytest.approx(4.0, abs=0.01)  # 5 - 1 (no refill: the clock stands)
    assert account.input_level == pytest.approx(3000 - 10, abs=0.01)  # held once
    reserves = [e for e in await ledger.events("a") if e.kind == "reserve"]
    assert [e.requests for e in reserves] == [1, 0, 0, 0, 0, 0, 0]
    assert (await ledger.usage("a", 3600)).requests == 1
    for i in range(2):  # two more calls of the run fit (3 in all), the first one counted once
        call = await ledger.reserve("a", f"call{i}", 10, 20, 5.0, run_id="run-1")
        await ledger.settle(call.id, 10, 20, 5.0, final=True)
    with pytest.raises(QuotaExceeded) as refused:
        await ledger.reserve("a", "call2", 10, 20, 5.0, run_id="run-1")
    assert refused.value.dimension == "max_model_calls"


async def test_other_final_reservations_are_returned_as_they_are(ledger, clock):
    ran = await ledger.reserve("a", "ran", 10, 20, 5.0)
    ran = await ledger.cancel(ran.id, Usage(10, 0, 0.0))  # it ran: its prompt is billed
    assert await ledger.reserve("a", "ran", 10, 20, 5.0) == ran
    lost = await ledger.reserve("a", "lost", 10, 20, 5.0)
    clock.advance(61)
    [lost] = await ledger.expire_due(lambda r: const(False))
    assert await ledger.reserve("a", "lost", 10, 20, 5.0) == lost  # expired: returned, even with nothing billed
    other = await ledger.reserve("a", "other", 10, 20, 5.0)
    await ledger.cancel(other.id, Usage())
    with pytest.raises(IdempotencyConflict):
        await ledger.reserve("a", "other", 10, 21, 5.0)
    assert (await ledger.account("a")).concurrent == 0
    assert [e.kind for e in await ledger.events("a")].count("reserve") == 3


async def test_a_reopen_the_quota_refuses_leaves_the_reservation_cancelled(ledger):
    first = await ledger.reserve("a", "later", 1, 1, 0.0)
    cancelled = await ledger.cancel(first.id, Usage())
    for i in range(3):
        await ledger.reserve("a", f"busy{i}", 1, 1, 0.0)
    with pytest.raises(QuotaExceeded, match="max_concurrent"):
        await ledger.reserve("a", "later", 1, 1, 0.0)
    assert await ledger.get(first.id) == cancelled


async def test_concurrent_retries_reopen_once(ledger):
    first = await ledger.reserve("a", "raced", 1, 1, 0.0)
    await ledger.cancel(first.id, Usage())
    retries = await asyncio.gather(*(ledger.reserve("a", "raced", 1, 1, 0.0) for _ in range(6)))
    assert {(r.id, r.status) for r in retries} == {(first.id, "open")}
    assert (await ledger.account("a")).concurrent == 1
    assert [e.kind for e in await ledger.events("a")].count("reserve") == 2


async def test_a_reservation_closed_in_the_next_gpu_window_gives_its_hold_back_to_its_own(open_ledger, clock):
    """Made in one GPU window and cancelled in the next, a reservation takes nothing off the new window's
    count: the hold of a reservation made there stays, and the window's budget is not overspent."""
    ledger = await open_ledger({"defaults": {"gpu_seconds": 10, "gpu_window_s": 3600}, "tenants": {"a": {}}}, clock)
    window_ms = 3_600_000.0
    clock.now_ms = (clock.now_ms // window_ms + 1) * window_ms - 1000.0  # a second before a window ends
    old = await ledger.reserve("a", "old", 1, 1, 8000.0)
    clock.advance(2)
    new = await ledger.reserve("a", "new", 1, 1, 8000.0)  # the new window's budget is fresh
    await ledger.cancel(old.id, Usage())
    assert (await ledger.account("a", "*")).gpu_window_used_ms == 8000.0
    with pytest.raises(QuotaExceeded, match="gpu_seconds"):
        await ledger.reserve("a", "more", 1, 1, 4000.0)
    await ledger.settle(new.id, 1, 1, 3000.0, final=True)
    assert (await ledger.account("a", "*")).gpu_window_used_ms == 3000.0


async def test_the_lifetime_gpu_total_is_summed_in_one_order_on_every_backend(open_ledger, clock):
    """An outside tester's case: a settlement adds what it billed to the lifetime total and takes off what it held
    in that order, ``(used + billed) - held``; PostgreSQL's function once took off ``billed - held``, which
    rounds otherwise, and admitted at the budget's edge what the others refuse."""
    ledger = await open_ledger({"defaults": {"gpu_seconds_total": 0.125}, "tenants": {"a": {}}}, clock)
    await ledger.reserve("a", "r1", 1, 1, 0.2)
    r2 = await ledger.reserve("a", "r2", 1, 1, 123.456)
    await ledger.settle(r2.id, 1, 1, 5.55, final=True)
    assert (await ledger.account("a")).gpu_total_used_ms == (0.2 + 123.456 + 5.55) - 123.456  # 5.750000000000014
    with pytest.raises(QuotaExceeded) as refused:
        await ledger.reserve("a", "r3", 1, 1, 119.25)
    assert refused.value.dimension == "gpu_seconds_total"


@pytest.mark.parametrize("gpu_ms", [5e-324, 1e-310, -0.5, float("nan")])
async def test_a_gpu_time_below_the_least_is_refused_by_every_backend(ledger, gpu_ms):
    """Not 0 and below 1e-300 ms: a product with a price underflows, which PostgreSQL's float8 raises on."""
    with pytest.raises(InvalidUsage, match="gpu_ms must be 0 or a number from 1e-300"):
        await ledger.reserve("a", "tiny", 1, 1, gpu_ms)
    r = await ledger.reserve("a", "ok", 1, 1, 1e-300)
    with pytest.raises(InvalidUsage, match="gpu_ms"):
        await ledger.settle(r.id, 1, 1, gpu_ms, final=True)
    assert (await ledger.settle(r.id, 1, 1, 0.0, final=True)).billed == Usage(1, 1, 0.0)


# --- reserve with the run claim: one call, as reserve then claim in one transaction ----------------------------
async def test_reserve_takes_the_run_claim_with_the_reservation(ledger, clock):
    r = await ledger.reserve("a", "with-claim", 10, 10, 1.0, claim_owner="gw-1", claim_lease_ms=30_000.0)
    assert r.status == "open" and r.claim is not None and r.claim.held_by("gw-1")
    assert (r.claim.until_ms, r.claim.now_ms, r.claim.remaining_ms) == (clock.now_ms + 30_000, clock.now_ms, 30_000)
    assert r.balances is not None and r.balances.concurrent == 1
    assert r == await ledger.get(r.id)  # the claim is not part of the record
    clock.advance(10)
    held = await ledger.claim(r.id, "gw-2", 30_000.0)  # another process: the claim is stored, gw-1's
    assert (held.owner, held.remaining_ms) == ("gw-1", 20_000.0)
    assert [e.kind for e in await ledger.events("a")] == ["reserve"]
    plain = await ledger.reserve("a", "without-claim", 10, 10, 1.0)
    assert plain.claim is None and (await ledger.claim(plain.id, "gw-2", 30_000.0)).held_by("gw-2")


async def test_a_claim_taken_on_a_retry_heartbeats_the_reservation(ledger, clock):
    r = await ledger.reserve("a", "beaten", 10, 10, 1.0)
    clock.advance(50)
    again = await ledger.reserve("a", "beaten", 10, 10, 1.0, claim_owner="gw-1", claim_lease_ms=30_000.0)
    assert again == r and again.claim is not None and again.claim.held_by("gw-1")
    clock.advance(20)  # past the TTL of 60 s; the claim beat 20 s ago
    assert await ledger.expire_due() == []
    assert (await ledger.get(r.id)).expires_at_ms == clock.now_ms - 20_000 + 60_000


async def test_a_retry_from_another_process_does_not_take_a_held_claim(ledger, clock):
    first = await ledger.reserve("a", "twice", 10, 10, 1.0, claim_owner="gw-1", claim_lease_ms=30_000.0)
    clock.advance(10)
    retry = await ledger.reserve("a", "twice", 10, 10, 1.0, claim_owner="gw-2", claim_lease_ms=30_000.0)
    assert retry == first and retry.claim is not None and not retry.claim.held_by("gw-2")
    assert (retry.claim.owner, retry.claim.remaining_ms, retry.claim.now_ms) == ("gw-1", 20_000.0, clock.now_ms)
    assert (await ledger.account("a")).concurrent == 1  # deducted once
    assert [e.kind for e in await ledger.events("a")] == ["reserve"]
    renewed = await ledger.reserve("a", "twice", 10, 10, 1.0, claim_owner="gw-1", claim_lease_ms=30_000.0)
    assert renewed.claim is not None and renewed.claim.held_by("gw-1") and renewed.claim.remaining_ms == 30_000.0
    assert (await ledger.claim(first.id, "gw-2", 30_000.0)).remaining_ms == 30_000.0  # renewed: stored


async def test_a_retry_after_the_claim_lapsed_takes_it(ledger, clock):
    first = await ledger.reserve("a", "lapsed", 10, 10, 1.0, claim_owner="gw-1", claim_lease_ms=30_000.0)
    clock.advance(30)  # exactly at the lease's end: lapsed
    retry = await ledger.reserve("a", "lapsed", 10, 10, 1.0, claim_owner="gw-2", claim_lease_ms=5_000.0)
    assert retry == first and retry.claim is not None and retry.claim.held_by("gw-2")
    assert retry.claim.until_ms == clock.now_ms + 5_000
    assert (await ledger.claim(first.id, "gw-1", 30_000.0)).owner == "gw-2"


async def test_a_final_reservation_is_returned_without_a_claim(ledger, clock):
    first = await ledger.reserve("a", "done", 10, 10, 1.0, claim_owner="gw-1", claim_lease_ms=30_000.0)
    done = await ledger.settle(first.id, 10, 5, 1.0, final=True)
    retry = await ledger.reserve("a", "done", 10, 10, 1.0, claim_owner="gw-2", claim_lease_ms=30_000.0)
    assert retry == done and retry.status == "settled" and retry.claim is None
    with pytest.raises(ReservationFinal):
        await ledger.claim(first.id, "gw-2", 30_000.0)
    # Cancelled with nothing billed, it re-opens: charged again, and claimed afresh (the old claim went with it).
    other = await ledger.reserve("a", "left", 10, 10, 1.0, claim_owner="gw-1", claim_lease_ms=30_000.0)
    await ledger.cancel(other.id, Usage())
    reopened = await ledger.reserve("a", "left", 10, 10, 1.0, claim_owner="gw-2", claim_lease_ms=30_000.0)
    assert (reopened.id, reopened.status) == (other.id, "open")
    assert reopened.claim is not None and reopened.claim.held_by("gw-2")
    assert (await ledger.claim(other.id, "gw-1", 30_000.0)).owner == "gw-2"


async def test_an_idempotency_conflict_takes_no_claim(ledger, clock):
    r = await ledger.reserve("a", "conflict", 10, 10, 1.0)
    with pytest.raises(IdempotencyConflict):
        await ledger.reserve("a", "conflict", 10, 11, 1.0, claim_owner="gw-1", claim_lease_ms=30_000.0)
    assert (await ledger.claim(r.id, "gw-2", 30_000.0)).held_by("gw-2")  # gw-1 holds nothing
    with pytest.raises(IdempotencyConflict):
        await ledger.reserve("a", "conflict", 10, 11, 1.0, claim_owner="gw-2", claim_lease_ms=1.0)
    assert (await ledger.claim(r.id, "gw-1", 30_000.0)).remaining_ms == 30_000.0  # gw-2's lease unchanged


async def test_a_quota_refusal_writes_no_reservation_and_no_claim(ledger, clock):
    for i in range(3):
        await ledger.reserve("a", f"busy-{i}", 10, 10, 1.0)
    with pytest.raises(QuotaExceeded, match="max_concurrent"):
        await ledger.reserve("a", "refused", 10, 10, 1.0, claim_owner="gw-1", claim_lease_ms=30_000.0)
    assert "refused" not in {r.request_id for r in await ledger.reservations("a")}
    assert [e.kind for e in await ledger.events("a")] == ["reserve"] * 3
    # A re-open refused: the reservation stays cancelled, unclaimed.
    busy = await ledger.reservations("a")
    await ledger.cancel(busy[0].id, Usage())
    await ledger.reserve("a", "busy-3", 10, 10, 1.0)
    with pytest.raises(QuotaExceeded, match="max_concurrent"):
        await ledger.reserve("a", busy[0].request_id, 10, 10, 1.0, claim_owner="gw-1", claim_lease_ms=30_000.0)
    assert (await ledger.get(busy[0].id)).status == "cancelled"
    with pytest.raises(ReservationFinal):
        await ledger.claim(busy[0].id, "gw-1", 30_000.0)


@pytest.mark.parametrize(("owner", "lease_ms", "match"), [("", 1000.0, "owner"), ("gw", 0.0, "lease_ms")])
async def test_a_bad_claim_with_a_reserve_reserves_nothing(ledger, owner, lease_ms, match):
    with pytest.raises(InvalidUsage, match=match):
        await ledger.reserve("a", "bad", 10, 10, 1.0, claim_owner=owner, claim_lease_ms=lease_ms)
    assert await ledger.reservations("a") == []


async def test_concurrent_reserves_of_one_request_id_leave_exactly_one_claim_holder(ledger):
    rs = await asyncio.gather(
        *(ledger.reserve("a", "raced", 10, 10, 1.0, claim_owner=f"gw-{i}", claim_lease_ms=30_000.0) for i in range(8))
    )
    assert len({r.id for r in rs}) == 1 and (await ledger.account("a")).concurrent == 1
    winners = [f"gw-{i}" for i, r in enumerate(rs) if r.claim is not None and r.claim.held_by(f"gw-{i}")]
    assert len(winners) == 1 and {r.claim.owner for r in rs if r.claim is not None} == set(winners), rs
