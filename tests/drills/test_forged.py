"""Drill ``forged`` (fairgate.drills.forged): about 70 requests try every header, body, query, credential and
delegation trick to be billed as a victim tenant that sends nothing; none may be, and every tenant's usage
must be exactly what it legitimately sent.

One run on an in-process stack: under a second of load, about 2 s of wall time."""

from __future__ import annotations

import pytest

from fairgate.drills import DrillOptions
from fairgate.drills.forged import ATTACKER, CLIENT, NOBODY, VICTIM, run
from tests.drills.conftest import timed_run

WALL_S_MAX = 45.0


@pytest.mark.serial  # a live stack: runs alone after the parallel part of the suite (scripts/test)
def test_no_trick_bills_another_tenant_and_the_victims_usage_stays_zero():
    timed = timed_run(run, DrillOptions(compare=None))
    result, summary = timed.result, timed.summary
    figs = result.main
    groups = {a.attack.group for a in figs.attacks}
    assert {"body", "header", "query", "authorization", "delegation", "admin", "request id", "read"} <= groups, summary
    # The controls work: a refusal below means the trick, not a broken stack.
    assert all(a.outcome.status == 200 for a in figs.attacks if a.attack.group == "control"), summary
    # Every attack answered as expected; the refused ones reserved nothing anywhere.
    assert not result.problems(), summary
    refused = [a for a in figs.attacks if a.attack.billed_to == NOBODY]
    assert len(refused) >= 30 and all(not a.reservations for a in refused), summary
    assert all(a.outcome.status in (400, 401, 403) for a in refused), summary
    # The victim: nothing at all, in the ledger or on the replicas.
    assert figs.usage[VICTIM] == (0, 0, 0, 0.0) and figs.victim_events == 0, summary
    assert figs.victim_salt_ms == 0.0, summary
    # The attacker and the client pay exactly for what they legitimately sent.
    expected = result.expected_usage()
    for tenant in (ATTACKER, CLIENT):
        assert (figs.usage[tenant][0], figs.usage[tenant][2]) == expected[tenant], summary
    assert expected[ATTACKER][0] >= 25 and expected[CLIENT][0] >= 3, summary
    # The history checker, each attack's id keyed by the tenant it must bill (nobody for a refusal): every
    # reservation is one of those, billed exactly what its answer's usage said; none under the victim.
    history = figs.history
    served = sum(n for n, _ in expected.values())
    assert history.attempts == len(figs.attacks) and history.reservations == served, history.table()
    assert history.discrepancies == (), history.table()
    assert result.passed, summary
    timed.assert_within(WALL_S_MAX)
