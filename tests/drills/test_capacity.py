"""Drill ``capacity`` (fairgate.drills.capacity): one of two emulated replica processes is SIGKILLed mid-load;
batch yields first, the interactive tenants split what is left by weight (2 : 1), and every request ends in
a success or an explicit error to its client.

One run: two ``fairgate emulate`` processes, the gateway in this process (an SQLite ledger), ``gold`` (weight
2, 24 clients), ``silver`` (weight 1, 12 clients, 12 more from the removal on) and ``bulk`` (batch pool, 40
clients); the replica is killed at 10 s of 34; about 45 s of wall time.

Measured on the shared two-core machine: bulk 27-28 % of the GPU before the removal, 0.0 % after (yielded
2.6-5 s after the kill: its running requests ran out, nothing is preempted); gold / silver 1.97-1.99 in the
ledger after the removal, 1.99-2.01 by the replicas' own charge rule (fcfs: 0.92, so the weights, not the
demand, make the split); 48 requests ended in an explicit error (24 streams cut with the replica, 24 sent to
it in the instant before the gateway marked it down: HTTP 502), none hung, no reservation open, the ledger's
settled / cancelled reservations equal to the successes / errors. With a 10-s window after the removal
(a 28-s run) the ledger's ratio ranged 2.00-2.25: too short a window for +-10 %.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from fairgate.drills import DrillOptions
from fairgate.drills.capacity import CapacityConfig, lost_requests, run
from tests.conftest import timing_claims_hold_here
from tests.drills.conftest import timed_run

WALL_S_MAX = 60.0


@pytest.mark.serial  # timing-sensitive: runs alone after the parallel part of the suite (scripts/test)
def test_one_replica_removed_batch_yields_interactive_keep_weights_nothing_lost():
    timed = timed_run(run, DrillOptions(policy="gpu_fair", compare=None))
    result, summary = timed.result, timed.summary
    print(summary)
    config, figs = result.config, result.main
    batch = figs.tenants[config.batch]
    # The fault was real: streams on the killed replica were cut, and their clients were told.
    assert figs.errors > 0, summary
    for t in figs.tenants.values():
        errors = t.requests.errors
        assert all(code.startswith(("502", "stream:upstream_error", "connection")) for code in errors), summary
        assert not lost_requests(t), summary
    # The history checker over every request id: nothing run, reserved or billed twice; a stream the kill cut
    # billed what its client received; the survivor's counts and the killed replica's last ones (a lower bound)
    # agree with the ledger; nothing open, every account back to 0.
    history = figs.history
    assert history.requests == history.attempts == figs.sent > 100, history.table()
    transport = sum(t.requests.errors.get("connection", 0) for t in figs.tenants.values())
    assert history.reservations == figs.sent - transport, history.table()
    assert history.discrepancies == (), history.table()
    # Batch had a real share before, and yielded it after (how fast, and the split, are timing claims).
    assert batch.share_before > 0.10, summary
    assert batch.share_after <= config.batch_share_after_max, summary
    timing_claims_hold_here("how fast batch yielded, the interactive tenants' ratio and the wall time")
    assert figs.converge_s is not None and figs.converge_s <= config.converge_s_max, summary
    # The interactive tenants split the capacity left by weight.
    assert abs(figs.ratio(config) / config.weight_ratio() - 1) <= config.ratio_tolerance, summary
    assert result.passed, summary
    timed.assert_within(WALL_S_MAX)


@pytest.mark.serial
def test_equal_demand_before_the_removal_the_weights_still_hold_after_it():
    """gold and silver both send 20 clients: before the removal neither is contended (1 : 1, all they ask),
    so gold's weighted counter grows half as fast as silver's. Found by this drill: gold banked the difference
    and took 3-7x silver's GPU for about 30 s after the removal (3.45 over 18-34 s); fixed, a tenant whose
    queue was empty is lifted towards the policy's virtual time even while it runs (2.06 measured)."""
    timing_claims_hold_here("the interactive tenants' ratio after the removal (a fairness figure, nothing else)")
    config = replace(CapacityConfig(), clients={"gold": 20, "silver": 20, "bulk": 40}, surge={})
    result = run(DrillOptions(policy="gpu_fair", compare=None), config)
    print(result.summary())
    assert abs(result.main.ratio(config) / config.weight_ratio() - 1) <= config.ratio_tolerance, result.summary()
