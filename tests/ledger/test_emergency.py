"""The ledger goes away mid-load (a real cut between the client and PostgreSQL): reject tiers get
LedgerUnavailable, emergency tiers stay within their local budget, and after recovery every grant and
every journalled settlement is in the ledger, reconciling exactly."""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlparse

import pytest

from fairgate.harness.proxy import CuttableProxy
from fairgate.ledger import (
    IdempotencyConflict,
    InvalidUsage,
    LedgerUnavailable,
    ReservationFinal,
    Usage,
    connect,
    quotas_from_dict,
)
from fairgate.ledger.emergency import ResilientLedger, duplicate_id, late_id

QUOTAS = {
    "tiers": {
        "free": {"on_ledger_unavailable": "reject"},
        "critical": {"on_ledger_unavailable": "emergency", "emergency": {"requests": 3, "tokens": 1000, "seconds": 30}},
    },
    "defaults": {"max_concurrent": 50},
    "tenants": {"sandbox": {"tier": "free"}, "bank": {"tier": "critical"}},
}


@pytest.fixture
async def cut_ledger(postgres_url, tmp_path):  # type: ignore[no-untyped-def]
    parts = urlparse(postgres_url)
    proxy = await CuttableProxy(parts.hostname or "127.0.0.1", parts.port or 5432).start()
    token = f"fge_{tmp_path.name[-12:].replace('-', '_').lower()}"
    url = f"{parts.scheme}://{parts.username or 'postgres'}@127.0.0.1:{proxy.port}{parts.path}?schema={token}"
    ledger = await connect(url, quotas_from_dict(QUOTAS))
    yield ledger, proxy, tmp_path / "journal.jsonl"
    proxy.restore()
    await ledger.drop_schema()
    await ledger.close()
    await proxy.close()


async def test_outage_reject_and_emergency_then_recover(cut_ledger):
    ledger, proxy, journal = cut_ledger
    front = ResilientLedger(ledger, journal)
    before = await front.reserve("bank", "b0", 100, 100, 10.0)  # placed before the outage
    proxy.cut()
    with pytest.raises(LedgerUnavailable):
        await front.reserve("sandbox", "s1", 10, 10, 1.0)  # reject tier: 503 upstream of here
    grants = [await front.reserve("bank", f"b{i}", 100, 200, 10.0) for i in (1, 2, 3)]
    assert all(g.id.startswith("emg-") for g in grants)
    with pytest.raises(LedgerUnavailable, match="budget"):
        await front.reserve("bank", "b4", 10, 10, 1.0)  # 3 requests granted: bounded
    assert (await front.reserve("bank", "b2", 100, 200, 10.0)).id == grants[1].id  # a retry, not a new grant
    await front.settle(grants[0].id, 100, 150, 12.0, final=True)
    await front.cancel(grants[1].id, Usage(100, 20, 3.0))
    await front.settle(grants[2].id, 100, 40, 5.0)  # still streaming when the ledger returns
    with pytest.raises(LedgerUnavailable):
        await front.settle(before.id, 100, 60, 9.0, final=True)  # journalled, not lost
    proxy.restore()
    await asyncio.sleep(0.1)
    report = await _recover_when_back(front)
    assert (report.grants_settled, report.settlements_applied, report.left) == (2, 1, [])
    rows = {r.request_id: r for r in await ledger.reservations("bank")}
    assert rows["b0"].status == "settled" and rows["b0"].billed == Usage(100, 60, 9.0)
    assert rows["b1"].status == "settled" and rows["b1"].billed == Usage(100, 150, 12.0)
    assert rows["b2"].status == "cancelled" and rows["b2"].billed == Usage(100, 20, 3.0)
    assert rows["b3"].status == "open" and rows["b3"].billed == Usage(100, 40, 5.0)
    assert "b4" not in rows and not await ledger.reservations("sandbox")
    # Totals reconcile: the event log equals the reservations' billed usage.
    events = await ledger.events("bank")
    assert sum(e.output_tokens for e in events) == sum(r.billed.output_tokens for r in rows.values())
    # The grant still open is settled by the next recovery; then the journal is empty.
    await front.settle(grants[2].id, 100, 90, 8.0, final=True)
    report = await front.recover()
    assert report.grants_settled == 1 and front.outstanding() == 0
    assert (await ledger.get(rows["b3"].id)).billed == Usage(100, 90, 8.0)


async def test_emergency_window_is_bounded_in_time(cut_ledger):
    ledger, proxy, journal = cut_ledger
    now = [0.0]
    front = ResilientLedger(ledger, journal, clock=lambda: now[0])
    proxy.cut()
    await front.reserve("bank", "t1", 10, 10, 1.0)
    now[0] += 31_000.0
    with pytest.raises(LedgerUnavailable, match="window"):
        await front.reserve("bank", "t2", 10, 10, 1.0)


async def test_the_front_serves_the_whole_request_path(cut_ledger):
    ledger, proxy, journal = cut_ledger
    front = ResilientLedger(ledger, journal)
    placed = await front.reserve("bank", "p0", 10, 10, 1.0)
    assert await front.get(placed.id) == await ledger.get(placed.id)
    assert await front.account("bank") == await ledger.account("bank")
    await front.heartbeat(placed.id)
    assert await front.expire_due() == []
    proxy.cut()
    with pytest.raises(LedgerUnavailable):
        await front.account("bank")  # no local stand-in for the balances
    with pytest.raises(LedgerUnavailable):
        await front.heartbeat(placed.id)
    grant = await front.reserve("bank", "g1", 10, 10, 1.0)
    assert await front.get(grant.id) == grant  # answered here, ledger or not
    await front.heartbeat(grant.id)  # nothing in the ledger to keep alive yet: a no-op
    assert await front.enqueue(grant.id) is None and await front.dequeue(grant.id) is None
    await front.settle(grant.id, 10, 4, 1.0)
    assert await front.expire_due() == []  # held: the grant's usage is not in the ledger yet
    proxy.restore()
    await _recover_when_back(front)
    live = front.live_id(grant.id)
    assert live is not None and live != grant.id  # replayed while running: it lives under a ledger id now
    await front.heartbeat(grant.id)  # beats the ledger's reservation
    assert (await ledger.get(live)).billed == Usage(10, 4, 1.0)


async def _recover_when_back(front: ResilientLedger):  # type: ignore[no-untyped-def]
    for _ in range(50):  # the pool reconnects on its own schedule
        try:
            return await front.recover()
        except LedgerUnavailable:
            await asyncio.sleep(0.2)
    return await front.recover()


async def test_a_grant_takes_only_usage_the_ledger_would(cut_ledger):
    """An emergency grant is checked as the ledger checks a reservation: amounts, the output cap, amounts
    that only grow, a retry's arguments. What it refuses is not journalled, so the replay settles the rest."""
    ledger, proxy, journal = cut_ledger
    proxy.cut()
    front = ResilientLedger(ledger, journal)
    grant = await front.reserve("bank", "g1", 10, 100, 1.0)
    with pytest.raises(IdempotencyConflict):
        await front.reserve("bank", "g1", 10, 99, 1.0)  # the same id, other arguments
    await front.settle(grant.id, 10, 40, 2.0)
    for bad in ((10, 500, 2.0), (10, 40, float("nan")), (10, 30, 2.0), (-1, 40, 2.0), (10, 40, "2")):
        with pytest.raises(InvalidUsage):
            await front.settle(grant.id, *bad, final=True)  # type: ignore[arg-type]
    with pytest.raises(InvalidUsage):
        await front.cancel(grant.id, (10, 40, 2.0))  # type: ignore[arg-type]
    await front.settle(grant.id, 10, 60, 3.0, final=True)
    restarted = ResilientLedger(ledger, journal)  # a new process reads the grant as it was left: final
    with pytest.raises(ReservationFinal):
        await restarted.settle(grant.id, 10, 70, 3.0, final=True)
    proxy.restore()
    report = await _recover_when_back(restarted)
    assert (report.grants_settled, report.left, restarted.outstanding()) == (1, [], 0)
    [row] = await ledger.reservations("bank")
    assert row.request_id == "g1" and row.status == "settled" and row.billed == Usage(10, 60, 3.0)


async def test_usage_the_ledger_refuses_at_replay_is_reported_and_does_not_hold_the_sweep(cut_ledger):
    """A journal whose grant usage the ledger refuses (written by an older process, or edited): the replay
    reports it and goes on with the rest; the sweep is not held by it for good."""
    ledger, proxy, journal = cut_ledger
    proxy.cut()
    front = ResilientLedger(ledger, journal)
    bad, good = [await front.reserve("bank", f"g{i}", 10, 100, 1.0) for i in (1, 2)]
    await front.settle(good.id, 10, 20, 1.0, final=True)
    with journal.open("a") as handle:  # over the reservation's output cap, as no check would let in now
        handle.write(json.dumps({"type": "grant_usage", "id": bad.id, "usage": [10, 500, 1.0], "status": "settled"}))
        handle.write("\n")
    proxy.restore()
    report = await _recover_when_back(ResilientLedger(ledger, journal))
    assert report.grants_settled == 1 and len(report.left) == 1 and bad.id in report.left[0]
    assert "max_output_tokens" in report.left[0]
    rows = {r.request_id: r for r in await ledger.reservations("bank")}
    assert rows["g2"].status == "settled" and rows["g2"].billed == Usage(10, 20, 1.0)
    assert rows["g1"].status == "open" and rows["g1"].billed == Usage()  # expires at its TTL
    assert ResilientLedger(ledger, journal).outstanding() == 0


async def test_a_process_does_not_grant_a_request_id_it_saw_final(cut_ledger):
    """The ledger is down; a client retries a request this process completed before it. Granting it would
    run it a second time; the process answers from what the ledger last told it instead."""
    ledger, proxy, journal = cut_ledger
    front = ResilientLedger(ledger, journal)
    done = await front.reserve("bank", "done", 10, 100, 1.0)
    await front.settle(done.id, 10, 30, 2.0, final=True)
    proxy.cut()
    again = await front.reserve("bank", "done", 10, 100, 1.0)
    assert (again.id, again.status, again.billed) == (done.id, "settled", Usage(10, 30, 2.0))
    with pytest.raises(IdempotencyConflict):
        await front.reserve("bank", "done", 10, 50, 1.0)  # another max_tokens: not a retry, not granted
    assert front.outstanding() == 0 and not journal.exists()


async def test_a_request_id_that_ran_elsewhere_too_is_billed_under_a_duplicate_id(cut_ledger):
    """Process B never saw request "done" (A served it). During an outage B grants a retry of it, which runs
    and delivers 30 tokens; it grants "other-args" too, which A had reserved with other arguments. Both runs
    were delivered, so both are billed: B's under ``<id>#dup-<grant>``; A's billing is untouched."""
    ledger, proxy, journal = cut_ledger
    done = await ledger.reserve("bank", "done", 10, 100, 1.0)  # process A's
    await ledger.settle(done.id, 10, 30, 2.0, final=True)
    other = await ledger.reserve("bank", "other-args", 10, 100, 1.0)
    await ledger.settle(other.id, 10, 5, 1.0, final=True)
    front_b = ResilientLedger(ledger, journal)
    proxy.cut()
    twice = await front_b.reserve("bank", "done", 10, 100, 1.0)
    conflicting = await front_b.reserve("bank", "other-args", 10, 60, 1.0)
    assert twice.id.startswith("emg-") and conflicting.id.startswith("emg-")
    await front_b.settle(twice.id, 10, 30, 2.0, final=True)
    await front_b.settle(conflicting.id, 10, 7, 1.0, final=True)
    proxy.restore()
    report = await _recover_when_back(front_b)
    assert (report.grants_settled, report.left, front_b.outstanding(), front_b.parked()) == (2, [], 0, [])
    rows = {r.request_id: r for r in await ledger.reservations("bank")}
    assert rows[duplicate_id({"id": twice.id, "request_id": "done"})].billed == Usage(10, 30, 2.0)
    assert rows[duplicate_id({"id": conflicting.id, "request_id": "other-args"})].billed == Usage(10, 7, 1.0)
    assert rows["done"].billed == Usage(10, 30, 2.0) and rows["other-args"].billed == Usage(10, 5, 1.0)


async def test_a_grant_the_ledger_will_not_take_is_parked_and_does_not_hold_expiry(cut_ledger):
    """A grant whose usage the ledger refuses at replay (here: settlement frozen for the tenant meanwhile) is
    parked with its usage and reason for the operator, and the journal empties, so expiry resumes
    (``expire_due`` is held only while the journal holds records)."""
    ledger, proxy, journal = cut_ledger
    front = ResilientLedger(ledger, journal)
    proxy.cut()
    grant = await front.reserve("bank", "frozen-out", 10, 100, 1.0)
    await front.settle(grant.id, 10, 30, 2.0, final=True)
    proxy.restore()
    await _recover_when_back(ResilientLedger(ledger, journal.with_name("warm-up.jsonl")))  # reconnected
    await ledger.freeze("bank", "reconciliation found a difference")
    report = await front.recover()
    assert front.outstanding() == 0 and report.grants_settled == 0 and len(report.left) == 1, report
    [parked] = front.parked()
    assert parked["request_id"] == "frozen-out" and parked["usage"] == [10, 30, 2.0], parked
    assert "frozen" in parked["reason"]


async def test_a_grant_left_open_by_a_killed_process_is_cancelled_with_its_usage(cut_ledger):
    """The process died mid-request during the outage; the one started after it must not keep the grant
    open (still running, as far as the journal says) forever, holding expiry."""
    ledger, proxy, journal = cut_ledger
    proxy.cut()
    killed = ResilientLedger(ledger, journal)
    grant = await killed.reserve("bank", "cut", 10, 100, 1.0)
    await killed.settle(grant.id, 10, 12, 1.5)  # a partial settlement, then kill -9
    restarted = ResilientLedger(ledger, journal)
    proxy.restore()
    report = await _recover_when_back(restarted)
    assert (report.grants_settled, report.left, restarted.outstanding()) == (1, [], 0)
    [row] = await ledger.reservations("bank")
    assert (row.request_id, row.status, row.billed) == ("cut", "cancelled", Usage(10, 12, 1.5))


class _FailsAfter:
    """The ledger, but ``reserve_args`` raises ``LedgerUnavailable`` after ``calls`` calls (an outage that
    comes back in the middle of a replay)."""

    def __init__(self, ledger, calls: int) -> None:  # type: ignore[no-untyped-def]
        self.ledger, self.quotas, self.calls = ledger, ledger.quotas, calls

    def limits(self, tenant: str, model_class: str):  # type: ignore[no-untyped-def]
        return self.ledger.limits(tenant, model_class)

    async def reserve_args(self, args, *claim):  # type: ignore[no-untyped-def]
        self.calls -= 1
        if self.calls < 0:
            raise LedgerUnavailable("down again")
        return await self.ledger.reserve_args(args, *claim)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.ledger, name)


async def test_a_replay_cut_after_its_first_grant_counts_it_once_when_run_again(cut_ledger, tmp_path):
    ledger, proxy, _ = cut_ledger
    journal = tmp_path / "cut-replay.jsonl"
    proxy.cut()
    front = ResilientLedger(ledger, journal)
    for i in (1, 2):
        grant = await front.reserve("bank", f"c{i}", 10, 100, 1.0)
        await front.settle(grant.id, 10, 20 * i, 1.0, final=True)
    proxy.restore()
    await _recover_when_back(ResilientLedger(ledger, tmp_path / "warm-up.jsonl"))  # the pool has reconnected
    with pytest.raises(LedgerUnavailable):  # c1 reserved and settled, then the ledger goes away again
        await ResilientLedger(_FailsAfter(ledger, 1), journal).recover()  # type: ignore[arg-type]
    again = ResilientLedger(ledger, journal)
    report = await again.recover()
    assert (report.grants_settled, report.left, again.outstanding(), again.parked()) == (2, [], 0, [])
    rows = {r.request_id: r for r in await ledger.reservations("bank")}
    assert rows["c1"].billed == Usage(10, 20, 1.0) and rows["c2"].billed == Usage(10, 40, 1.0)


class _OtherReplaysFirst:
    """The ledger, but the first ``reserve_args`` lets another process's replay (``other``) run to its end
    before it returns: the race of two processes replaying grants of one request id at once."""

    def __init__(self, ledger, other) -> None:  # type: ignore[no-untyped-def]
        self.ledger, self.quotas, self.other, self.raced = ledger, ledger.quotas, other, False

    def limits(self, tenant: str, model_class: str):  # type: ignore[no-untyped-def]
        return self.ledger.limits(tenant, model_class)

    async def reserve_args(self, args, *claim):  # type: ignore[no-untyped-def]
        r = await self.ledger.reserve_args(args, *claim)
        if not self.raced:
            self.raced = True
            await self.other.recover()  # reserves the same id (the same open reservation) and closes it
        return r

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.ledger, name)


async def test_two_processes_replaying_one_request_id_at_once_bill_both_runs(cut_ledger, tmp_path):
    """During an outage processes A and B each granted request "both" (a client retried it on the other) and
    each delivered it. Their replays race: B reserves, A reserves the same open reservation and closes it,
    then B's settlement finds it closed. Both runs are billed - A's under the id, B's as its duplicate - and
    nothing is parked."""
    ledger, proxy, _ = cut_ledger
    proxy.cut()
    front_a, front_b = ResilientLedger(ledger, tmp_path / "a.jsonl"), ResilientLedger(ledger, tmp_path / "b.jsonl")
    grant_a = await front_a.reserve("bank", "both", 10, 100, 1.0)
    grant_b = await front_b.reserve("bank", "both", 10, 100, 1.0)
    await front_a.settle(grant_a.id, 10, 30, 2.0, final=True)
    await front_b.settle(grant_b.id, 10, 25, 1.5, final=True)
    proxy.restore()
    await _recover_when_back(ResilientLedger(ledger, tmp_path / "warm-up.jsonl"))  # the pool has reconnected
    racing_b = ResilientLedger(_OtherReplaysFirst(ledger, front_a), tmp_path / "b.jsonl")  # type: ignore[arg-type]
    report = await racing_b.recover()
    assert (report.grants_settled, report.left, racing_b.outstanding(), racing_b.parked()) == (1, [], 0, [])
    assert front_a.outstanding() == 0 and front_a.parked() == []
    rows = {r.request_id: r for r in await ledger.reservations("bank")}
    assert rows["both"].billed == Usage(10, 30, 2.0), rows
    assert rows[duplicate_id({"id": grant_b.id, "request_id": "both"})].billed == Usage(10, 25, 1.5), rows


async def test_a_journalled_partial_settlement_a_later_one_billed_past_is_superseded_not_left(cut_ledger):
    """A stream's partial settlement that missed the ledger is journalled; the call's next one (cumulative,
    higher) reaches it. At replay the first is below what is billed: nothing to apply, and not a failure for
    the operator. One the ledger's amounts do not cover in every field is still left."""
    ledger, proxy, journal = cut_ledger
    front = ResilientLedger(ledger, journal)
    streaming = await front.reserve("bank", "streaming", 100, 200, 10.0)
    other = await front.reserve("bank", "other", 100, 200, 10.0)
    await front.settle(other.id, 100, 5, 1.0)
    proxy.cut()
    with pytest.raises(LedgerUnavailable):
        await front.settle(streaming.id, 100, 26, 2.0)
    with pytest.raises(LedgerUnavailable):
        await front.settle(other.id, 100, 3, 1.5)  # below what the ledger holds in output, above in GPU ms
    proxy.restore()
    await _recover_when_back(ResilientLedger(ledger, journal.with_name("warm-up.jsonl")))  # reconnected
    await front.settle(streaming.id, 100, 123, 9.0)
    report = await front.recover()
    assert (report.settlements_applied, report.settlements_superseded) == (0, 1), report
    assert len(report.left) == 1 and other.id in report.left[0] and "below what was billed" in report.left[0]
    assert (await ledger.get(streaming.id)).billed == Usage(100, 123, 9.0)


async def test_a_journalled_final_settlement_of_a_reservation_closed_meanwhile_bills_the_rest_late(cut_ledger):
    """A stream's final settlement missed the ledger and was journalled; before the replay, another process
    closed the reservation billing only what was settled (expiry, or a retry of the id elsewhere). The replay
    bills the rest under a reservation of its own (``late_id``), once: a replay again finds it by its id."""
    ledger, proxy, journal = cut_ledger
    front = ResilientLedger(ledger, journal)
    streaming = await front.reserve("bank", "closed-meanwhile", 100, 200, 10.0)
    await front.settle(streaming.id, 100, 14, 1.0)
    proxy.cut()
    with pytest.raises(LedgerUnavailable):
        await front.settle(streaming.id, 100, 36, 3.0, final=True)
    lines = journal.read_text()
    proxy.restore()
    await _recover_when_back(ResilientLedger(ledger, journal.with_name("warm-up.jsonl")))  # reconnected
    await ledger.cancel(streaming.id, Usage(100, 14, 1.0))  # another process closes it with what it knows
    report = await front.recover()
    assert (report.settlements_applied, report.settlements_late, report.left) == (0, 1, []), report
    journal.write_text(lines)  # a replay interrupted before the journal was rewritten runs again
    again = await ResilientLedger(ledger, journal).recover()
    assert (again.settlements_applied, again.settlements_late, again.left) == (1, 0, []), again  # billed before
    rows = {r.request_id: r for r in await ledger.reservations("bank")}
    late = rows[late_id(streaming)]
    assert late.status == "settled" and late.billed == Usage(0, 22, 2.0)
    assert rows["closed-meanwhile"].billed == Usage(100, 14, 1.0)
    assert len(rows) == 2


async def test_several_journalled_settlements_of_a_closed_reservation_bill_the_last_ones_rest_once(cut_ledger):
    """An outside tester's finding: a stream's partial settlements every 0.5 s and its final one all journalled,
    the reservation expired meanwhile: the replay billed the first partial's rest and refused the others (their
    late reserve had other arguments): 40 of 300 tokens billed. The last settlement's rest is billed, once; and a
    settlement reaching the ledger itself after the close bills its rest too (the next late reservation)."""
    ledger, proxy, journal = cut_ledger
    front = ResilientLedger(ledger, journal)
    streaming = await front.reserve("bank", "expired-meanwhile", 100, 400, 40.0)
    await front.settle(streaming.id, 100, 10, 1.0)
    proxy.cut()
    for tokens in (40, 80, 120):
        with pytest.raises(LedgerUnavailable):
            await front.settle(streaming.id, 100, tokens, tokens / 10)
    with pytest.raises(LedgerUnavailable):
        await front.settle(streaming.id, 100, 300, 30.0, final=True)
    proxy.restore()
    await _recover_when_back(ResilientLedger(ledger, journal.with_name("warm-up.jsonl")))  # reconnected
    await ledger.cancel(streaming.id, Usage(100, 10, 1.0))  # expired by another process, say
    report = await front.recover()
    assert (report.settlements_late, report.left) == (1, []), report
    rows = {r.request_id: r for r in await ledger.reservations("bank")}
    assert rows[late_id(streaming)].billed == Usage(0, 290, 29.0)
    # Another call's settlement reaching the ledger after its reservation closed bills its rest at once.
    other = await front.reserve("bank", "closed-live", 100, 400, 40.0)
    await ledger.cancel(other.id, Usage(100, 5, 0.5))
    await front.settle(other.id, 100, 50, 5.0, final=True)
    await front.settle(other.id, 100, 50, 5.0, final=True)  # repeated: billed once
    rows = {r.request_id: r for r in await ledger.reservations("bank")}
    assert rows[late_id(other)].billed == Usage(0, 45, 4.5) and late_id(other, 2) not in rows
    total = sum((r.billed.output_tokens for r in rows.values()), 0)
    assert total == 300 + 50, rows


async def test_usage_a_late_reservation_cannot_bill_is_parked_for_the_operator_once(cut_ledger):
    """A final settlement finds its reservation closed with less billed, and the late reservation that would
    bill the rest is refused (the tenant at its max_concurrent): the rest is parked (``parked``, as a grant the
    ledger would not take: ``/admin/reconcile``, ``fairgate ledger journal`` exit 1), once however often it is
    refused again."""
    ledger, _proxy, journal = cut_ledger
    front = ResilientLedger(ledger, journal)
    streaming = await front.reserve("bank", "closed-then-full", 100, 400, 40.0)
    await ledger.cancel(streaming.id, Usage(100, 5, 0.5))  # another process closes it with what it knew
    await asyncio.gather(*(ledger.reserve("bank", f"fill-{i}", 10, 10, 1.0) for i in range(50)))  # now full
    for _ in range(2):
        with pytest.raises(ReservationFinal, match="max_concurrent"):
            await front.settle(streaming.id, 100, 60, 6.0, final=True)
    parked = front.parked()
    assert [(p["request_id"], p["reservation"], p["usage"], p["status"]) for p in parked] == [
        (late_id(streaming), streaming.id, [0, 55, 5.5], "late")
    ]
    assert "max_concurrent" in parked[0]["reason"] and parked[0]["tenant"] == "bank"
    rows = {r.request_id for r in await ledger.reservations("bank")}
    assert late_id(streaming) not in rows
