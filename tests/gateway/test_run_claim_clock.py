"""How a gateway process holds its requests' run claims by its own clock (``CallRegistry``), renewed by the
liveness sweep (``background.sweep_once``), on a real SQLite ledger: a claim lapses by this process's clock no
later than by the ledger's, and a claim another process took reads as lapsed at once."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fairgate.gateway.background import Claimant, sweep_once
from fairgate.gateway.state import CallRegistry
from fairgate.ledger import connect, quotas_from_dict
from fairgate.ledger.emergency import ResilientLedger

LEASE_MS = 3000.0


def test_the_registry_holds_a_claim_until_its_lease_and_forgets_it_with_the_request():
    calls = CallRegistry()
    assert calls.run_claim_left_s("res-1", 0.0) == math.inf  # no ledger claim known: an emergency grant's
    calls.run_claim_held("res-1", 13.0)  # not registered: ignored
    assert calls.run_claim_left_s("res-1", 10.0) == math.inf
    assert calls.claim("alpha", "req-1", "res-1")
    calls.run_claim_held("res-1", 13.0)
    assert calls.run_claim_left_s("res-1", 10.0) == pytest.approx(3.0)
    assert calls.run_claim_left_s("res-1", 13.5) == pytest.approx(-0.5)
    calls.run_claim_lost("res-1")
    assert calls.run_claim_left_s("res-1", 0.0) == -math.inf
    calls.release("alpha", "req-1")
    assert calls.run_claim_left_s("res-1", 0.0) == math.inf


async def test_the_sweep_renews_each_claim_from_its_send_time_and_reports_one_lost(tmp_path: Path):
    now = [1_800_000_000_000.0]
    quotas = quotas_from_dict({"defaults": {}, "tenants": {"alpha": {}}})
    ledger = await connect(f"sqlite:///{tmp_path}/ledger.db", quotas, clock=lambda: now[0])
    try:
        front = ResilientLedger(ledger, tmp_path / "journal.jsonl")
        reserved = [await front.reserve("alpha", f"req-{i}", 10, 10, 5.0) for i in range(20)]
        for r in reserved:
            assert (await front.claim(r.id, "a", LEASE_MS)).held_by("a")
        now[0] += LEASE_MS + 1.0  # every claim lapsed; another process takes the last one
        assert (await front.claim(reserved[-1].id, "b", LEASE_MS)).held_by("b")
        told: dict[str, float | None] = {}
        clock = iter(float(t) for t in range(100, 200))  # this process's monotonic clock, one tick a read
        claimant = Claimant(lambda: [r.id for r in reserved], "a", LEASE_MS, told.__setitem__, lambda: next(clock))
        await sweep_once(front, claimant, expire=False)
    finally:
        await ledger.close()
    assert told.pop(reserved[-1].id) is None  # lost to "b"
    # The other 19 held, each until its renewal's send time (one clock read each, from 100 on) plus the lease.
    assert sorted(told.values()) == [100.0 + i + LEASE_MS / 1000.0 for i in range(19)], told
