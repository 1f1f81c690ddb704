"""A reserve that timed out may still commit once the ledger answers: the client was told 503, and the open
reservation would hold a concurrency slot, unseen, for a whole TTL. ``ResilientLedger.clear_doubts`` cancels
it - unless a retry of the request holds it now."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from fairgate.ledger import LedgerUnavailable, Usage, connect, quotas_from_dict
from fairgate.ledger.emergency import ResilientLedger

QUOTAS = {"tiers": {"free": {"on_ledger_unavailable": "reject"}}, "tenants": {"sandbox": {"tier": "free"}}}


class CommitsThenTimesOut:
    """The ledger, but its first ``timeouts`` reserves commit and then fail as a timeout would (the answer
    was lost)."""

    def __init__(self, ledger: Any, timeouts: int = 1) -> None:
        self.ledger, self.quotas, self.timeouts = ledger, ledger.quotas, timeouts

    def limits(self, tenant: str, model_class: str) -> Any:
        return self.ledger.limits(tenant, model_class)

    async def reserve_args(self, args: Any, *claim: Any) -> Any:
        reserved = await self.ledger.reserve_args(args, *claim)
        self.timeouts -= 1
        if self.timeouts >= 0:
            raise LedgerUnavailable("timed out")
        return reserved

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ledger, name)


@pytest.fixture
async def ledger(tmp_path: Path):  # type: ignore[no-untyped-def]
    opened = await connect(f"sqlite:///{tmp_path}/ledger.db", quotas_from_dict(QUOTAS))
    yield opened
    await opened.close()


async def test_a_reservation_committed_after_its_reserve_timed_out_is_cancelled(ledger, tmp_path: Path) -> None:
    front = ResilientLedger(CommitsThenTimesOut(ledger), tmp_path / "journal.jsonl")  # type: ignore[arg-type]
    with pytest.raises(LedgerUnavailable):
        await front.reserve("sandbox", "phantom", 10, 10, 1.0)  # the client gets 503
    [r] = await ledger.reservations("sandbox", "open")
    assert (await ledger.account("sandbox")).concurrent == 1 and front.doubtful() == 1
    assert await front.clear_doubts("gw-1/doubts", 1000.0) == 1
    assert (await ledger.get(r.id)).status == "cancelled" and (await ledger.get(r.id)).billed == Usage()
    assert (await ledger.account("sandbox")).concurrent == 0 and front.doubtful() == 0


async def test_a_retry_that_holds_the_reservation_keeps_it(ledger, tmp_path: Path) -> None:
    late = ResilientLedger(CommitsThenTimesOut(ledger, timeouts=2), tmp_path / "journal.jsonl")  # type: ignore[arg-type]
    with pytest.raises(LedgerUnavailable):
        await late.reserve("sandbox", "retried-elsewhere", 10, 10, 1.0)
    # The client's retry reached another process, which holds the reservation's run claim.
    retry = await ledger.reserve("sandbox", "retried-elsewhere", 10, 10, 1.0)
    assert (await ledger.claim(retry.id, "gw-2", 30_000.0)).held_by("gw-2")
    assert await late.clear_doubts("gw-1/doubts", 1000.0) == 0
    assert (await ledger.get(retry.id)).status == "open" and late.doubtful() == 0
    # A retry through the same front: it has the reservation, so it is no longer in doubt.
    with pytest.raises(LedgerUnavailable):
        await late.reserve("sandbox", "retried-here", 10, 10, 1.0)
    again = await late.reserve("sandbox", "retried-here", 10, 10, 1.0)
    assert late.doubtful() == 0 and await late.clear_doubts("gw-1/doubts", 1000.0) == 0
    assert (await ledger.get(again.id)).status == "open"


async def test_a_reservation_claimed_by_a_reserve_that_timed_out_is_cancelled_once_its_claim_lapses(
    ledger, tmp_path: Path
) -> None:
    """The gateway reserves with its run claim: a reserve that committed after it timed out holds this process's
    claim, for a run that never started. It stays in doubt until that claim lapses, then is cancelled."""
    late = ResilientLedger(CommitsThenTimesOut(ledger), tmp_path / "journal.jsonl")  # type: ignore[arg-type]
    with pytest.raises(LedgerUnavailable):
        await late.reserve("sandbox", "claimed", 10, 10, 1.0, claim_owner="gw-1", claim_lease_ms=300.0)
    [r] = await ledger.reservations("sandbox", "open")
    assert (await ledger.claim(r.id, "gw-2", 1000.0)).owner == "gw-1"  # taken with the reservation
    assert await late.clear_doubts("gw-1/doubts", 1000.0) == 0 and late.doubtful() == 1  # held: kept in doubt
    await asyncio.sleep(0.35)  # the claim lapses (nobody renews it: nothing runs)
    assert await late.clear_doubts("gw-1/doubts", 1000.0) == 1 and late.doubtful() == 0
    assert (await ledger.get(r.id)).status == "cancelled" and (await ledger.account("sandbox")).concurrent == 0
