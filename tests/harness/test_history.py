"""The history checker (``fairgate.harness.history``) on hand-made histories: a real SQLite ledger driven
through reserve / settle / cancel as a gateway drives it, client records written by hand, and replica counts
by hand. A clean history gives no discrepancy; each kind of fault gives its kind, for the right request id."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fairgate.harness.history import Bounds, Kind, LedgerState, ReplicaCounts, check_history, read_ledger_state
from fairgate.harness.records import RequestRecord
from fairgate.ledger import Ledger, Usage, connect, quotas_from_dict
from fairgate.ledger.emergency import late_base, late_id

QUOTAS = {"tenants": {"alpha": {}, "beta": {}}}
MODEL = "default"


@pytest.fixture
async def ledger(tmp_path: Path):  # type: ignore[no-untyped-def]
    opened = await connect(f"sqlite:///{tmp_path}/ledger.db", quotas_from_dict(QUOTAS))
    yield opened
    await opened.close()


def ok(rid: str, tokens: int, target: str = "A", prompt: int = 10) -> RequestRecord:
    """A whole streamed answer with its usage chunk."""
    return RequestRecord(
        rid, "alpha", target, 64, 0.0, outcome="ok", status=200, tokens=tokens, usage_input=prompt, usage_output=tokens
    )


def failed(rid: str, outcome: str, tokens: int = 0, target: str = "A", status: int | None = 200) -> RequestRecord:
    """An attempt cut short (``cut``, ``connection``, ``stream``) or refused (``error``, with ``status``)."""
    return RequestRecord(rid, "alpha", target, 64, 0.0, outcome=outcome, status=status, tokens=tokens)


async def served(ledger: Ledger, rid: str, output: int, prompt: int = 10, final: str = "settle") -> str:
    """Reserve ``rid`` and bill ``output`` tokens as a gateway does (partial settlement, then the final
    ``settle`` or ``cancel``; ``open``: left open); returns the reservation id."""
    r = await ledger.reserve("alpha", rid, prompt, 64, 100.0, MODEL)
    await ledger.settle(r.id, prompt, output // 2, 10.0)
    if final == "settle":
        await ledger.settle(r.id, prompt, output, 20.0, final=True)
    elif final == "cancel":
        await ledger.cancel(r.id, Usage(prompt, output, 20.0))
    return r.id


def replicas(sequences: int, tokens: int, running: int = 0, complete: bool = True) -> list[ReplicaCounts]:
    return [ReplicaCounts("replica-0", sequences, 0, tokens, running, 0, complete)]


async def state(ledger: Ledger) -> LedgerState:
    return await read_ledger_state(ledger, ["alpha", "beta"], [MODEL])


def kinds(report) -> list[tuple[str, str]]:  # type: ignore[no-untyped-def]
    return sorted((d.kind.value, d.subject) for d in report.discrepancies)


async def test_a_clean_history_with_retries_refusals_and_cuts_has_no_discrepancy(ledger):
    await served(ledger, "r1", 20)
    await served(ledger, "r2", 30, final="cancel")  # cut by its client after 28 tokens: 2 in flight, billed
    await served(ledger, "r3", 12, final="cancel")  # its gateway died after 12 billed; 14 delivered
    records = [
        ok("r1", 20),
        failed("r1", "error", target="B", status=409),  # a retry on the other process: refused
        failed("r2", "cut", tokens=28),
        failed("r3", "connection", tokens=14),
        failed("r4", "error", status=429),  # refused at admission: no reservation
    ]
    report = check_history(records, await state(ledger), replicas(3, 62))
    assert report.ok, report.table()
    assert (report.requests, report.attempts, report.reservations) == (4, 5, 3)
    assert report.table().endswith("0 discrepancies")


async def test_unbilled_and_overbilled_are_exact_for_whole_answers(ledger):
    await served(ledger, "short", 19)  # the client received 20: one token delivered free
    await served(ledger, "long", 21)  # the client received 20: one billed that was never sent
    report = check_history([ok("short", 20), ok("long", 20)], await state(ledger))
    assert kinds(report) == [("overbilled", "long"), ("unbilled", "short")]
    unbilled = next(d for d in report.discrepancies if d.kind is Kind.UNBILLED)
    assert unbilled.detail == "client received 20 (A:ok@20), billed 19 (settled): 1 unbilled (bound 0)"


async def test_a_cut_attempt_is_allowed_the_in_flight_bound_and_no_more(ledger):
    await served(ledger, "within", 10, final="cancel")
    await served(ledger, "beyond", 10, final="cancel")
    await served(ledger, "over", 40, final="cancel")
    records = [failed("within", "connection", tokens=10 + 64), failed("beyond", "connection", tokens=10 + 65)]
    records.append(failed("over", "cut", tokens=31))  # billed 9 more than its client read: bound 8
    report = check_history(records, await state(ledger), bounds=Bounds(unbilled_per_cut=64, overbilled_per_cut=8))
    assert kinds(report) == [("overbilled", "over"), ("unbilled", "beyond")]


async def test_an_id_reserved_twice_and_run_twice_is_caught(ledger):
    await served(ledger, "twice", 20)
    first = await ledger.reservations()
    # A second reservation under the same id (as a backend that lost its idempotency key would make).
    twin = dataclasses.replace(first[0], id=first[0].id[:-4] + "beef")
    events = await ledger.events()
    twin_events = [dataclasses.replace(e, seq=e.seq + 100, reservation_id=twin.id) for e in events]
    held = LedgerState((*first, twin), (*events, *twin_events), {})
    records = [failed("twice", "connection", tokens=5), ok("twice", 20, target="B")]
    report = check_history(records, held, replicas(2, 45))
    assert ("reserved_twice", "twice") in kinds(report)
    assert ("ran_twice", "twice") in kinds(report)
    assert ("ran_twice", "replicas") in kinds(report)  # 2 sequences for 1 id admitted


async def test_a_settlement_booked_twice_is_caught_in_the_event_log(ledger):
    await served(ledger, "r1", 20)
    held = await state(ledger)
    final = next(e for e in held.events if e.kind == "settle_final")
    doubled = dataclasses.replace(held, events=(*held.events, dataclasses.replace(final, seq=final.seq + 1)))
    report = check_history([ok("r1", 20)], doubled)
    assert [d.kind for d in report.discrepancies] == [Kind.BILLED_TWICE, Kind.BILLED_TWICE]
    assert "final events: settle_final 2" in report.discrepancies[0].detail
    assert "events sum to 30 output tokens, billed 20" in report.discrepancies[1].detail


async def test_open_reservations_and_held_counters_are_caught(ledger):
    await served(ledger, "stuck", 8, final="open")
    report = check_history([failed("stuck", "connection", tokens=8)], await state(ledger))
    assert kinds(report) == [("counters", "alpha/default"), ("open", "stuck")]
    counters = next(d for d in report.discrepancies if d.kind is Kind.COUNTERS)
    assert counters.detail == "concurrent 1, queued 0 (want 0, 0)"


async def test_tokens_without_a_reservation_and_reservations_without_a_client_are_caught(ledger):
    await served(ledger, "ghost", 5)
    report = check_history([ok("free", 12)], await state(ledger))
    assert kinds(report) == [("unknown", "alpha/ghost"), ("unreserved", "free")]


async def test_a_request_id_is_its_tenants_own(ledger):
    """Two tenants may send one request id (the ledger keys it by tenant): two histories, none twice. A
    reservation under another tenant than the client's record names is billed to the wrong tenant: the
    record's tokens are unreserved and the other tenant's reservation is one no client sent."""
    await served(ledger, "shared", 20)
    other = await ledger.reserve("beta", "shared", 10, 64, 100.0, MODEL)
    await ledger.settle(other.id, 10, 7, 5.0, final=True)
    beta = dataclasses.replace(ok("shared", 7), tenant="beta")
    assert check_history([ok("shared", 20), beta], await state(ledger)).discrepancies == ()
    await served(ledger, "stolen", 5)  # billed to alpha, though the client claimed to be beta
    report = check_history(
        [ok("shared", 20), beta, dataclasses.replace(ok("stolen", 5), tenant="beta")], await state(ledger)
    )
    assert kinds(report) == [("unknown", "alpha/stolen"), ("unreserved", "stolen")]


async def test_usage_that_differs_from_what_was_counted_or_billed_is_caught(ledger):
    await served(ledger, "r1", 20, prompt=10)
    record = dataclasses.replace(ok("r1", 20), usage_input=11, usage_output=21)
    report = check_history([record], await state(ledger))
    assert [d.kind for d in report.discrepancies] == [Kind.USAGE, Kind.USAGE]
    assert report.by_kind() == {"usage": 2}


async def test_replica_counts_are_held_to_what_was_billed(ledger):
    await served(ledger, "r1", 20)
    held = await state(ledger)
    records = [ok("r1", 20)]
    assert kinds(check_history(records, held, replicas(1, 19))) == [("replica_tokens", "replicas")]  # billed > made
    assert kinds(check_history(records, held, replicas(1, 21))) == [("replica_tokens", "replicas")]  # made, unbilled
    assert kinds(check_history(records, held, replicas(1, 20, running=1))) == [
        ("ran_twice", "replicas"),
        ("replica_busy", "replica-0"),
    ]
    # A replica lost midway: its counts are a lower bound, so fewer tokens than billed is no discrepancy.
    assert check_history(records, held, replicas(1, 12, complete=False)).ok


async def test_the_table_names_each_discrepancy(ledger):
    await served(ledger, "a", 3)
    report = check_history([ok("a", 4)], await state(ledger))
    lines = report.table().splitlines()
    assert lines[0] == "1 request ids, 1 attempts, 1 reservations: 1 (unbilled 1)"
    assert lines[1].split() == ["kind", "subject", "what", "differs"]
    assert lines[2].startswith("unbilled  a ")


async def test_a_refunded_call_retried_under_its_reopened_reservation_is_not_a_discrepancy(ledger):
    """The upstream failed the first attempt before it delivered anything (502, refunded: cancelled billing
    nothing); the retry re-opens the reservation and runs: one life billed 0, one billed what was received."""
    r = await ledger.reserve("alpha", "refunded", 10, 64, 100.0, MODEL)
    await ledger.cancel(r.id, Usage())
    assert (await ledger.reserve("alpha", "refunded", 10, 64, 100.0, MODEL)).id == r.id  # re-opened
    await ledger.settle(r.id, 10, 20, 20.0, final=True)
    refused = dataclasses.replace(failed("refunded", "error", status=502), code="upstream_error")
    report = check_history([refused, ok("refunded", 20, target="B")], await state(ledger), replicas(2, 37))
    assert report.ok, report.table()
    # Reserved again after a cancel that billed something: the id ran twice.
    r2 = await ledger.reserve("alpha", "billed-then-again", 10, 64, 100.0, MODEL)
    await ledger.cancel(r2.id, Usage(10, 5, 3.0))
    held = await state(ledger)
    again = next(e for e in held.events if e.reservation_id == r2.id and e.kind == "reserve")
    doubled = dataclasses.replace(held, events=(*held.events, dataclasses.replace(again, seq=10_000)))
    report = check_history([failed("billed-then-again", "stream", tokens=5)], doubled)
    assert ("reserved_twice", "billed-then-again") in kinds(report), report.table()


async def test_a_late_reservation_counts_for_the_request_id_whose_closed_reservation_it_bills(ledger):
    """``<id>#late-<reservation>`` (``ResilientLedger._bill_late``): the rest of what a stream delivered after its
    reservation closed is billed under it, and the checker counts it for ``<id>``; without it, ``<id>`` is
    unbilled."""
    reservation_id = await served(ledger, "r1", 20, final="cancel")  # closed with 20 by another process, say
    closed = await ledger.get(reservation_id)
    late = await ledger.reserve("alpha", late_id(closed), 10, 200, 100.0, MODEL)
    records = [failed("r1", "stream", tokens=150)]
    before = kinds(check_history(records, await state(ledger)))  # the late one open, nothing billed on it yet
    assert ("unbilled", "r1") in before and ("reserved_twice", "r1") not in before, before
    await ledger.settle(late.id, 0, 130, 30.0, final=True)
    report = check_history(records, await state(ledger))
    assert report.ok, report.table()
    assert late_base(late_id(closed, 2)) == "r1" and late_base("r1#late-x#y") == "r1#late-x#y"
