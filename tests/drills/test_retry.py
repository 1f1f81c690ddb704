"""Drill ``retry`` (fairgate.drills.retry): 300 request ids over two tenants, each re-sent 1-3 times with
jitter (while the original runs, after it ended, all at once, after the client gave up on it, with a changed
body, or through the openai SDK's own retries); not one is run, reserved, billed or deducted twice.

One run: replicas in this process (tapped), the gateway as a process; about 10 s of load and 12 s of wall
time on the shared two-core machine."""

from __future__ import annotations

import pytest

from fairgate.drills import DrillOptions
from fairgate.drills.retry import PATTERNS, RetryConfig, run
from tests.drills.conftest import timed_run

WALL_S_MAX = 45.0


@pytest.mark.serial  # timing-sensitive: runs alone after the parallel part of the suite (scripts/test)
def test_re_sent_request_ids_are_never_run_billed_or_deducted_twice():
    timed = timed_run(run, DrillOptions(compare=None))
    result, summary = timed.result, timed.summary
    config, figs = RetryConfig(), result.main
    # The faults were injected: every pattern, and more re-sends than ids.
    assert all(sum(1 for i in figs.ids if i.plan.pattern == p) >= 10 for p in PATTERNS), summary
    assert sum(1 for a in figs.attempts if a.role != "original") > 1.5 * config.ids, summary
    answers = figs.answers
    assert answers["409 request_in_progress"] > 0 and answers["409 request_already_completed"] > 0, summary
    assert answers["409 idempotency_conflict"] > 0 and answers["cut by client"] > 0, summary
    # Exactly one reservation, one replica run and at most one 200 per id; the rest 409 (or cut by the client).
    assert all(i.reservations == 1 == i.reserve_events for i in figs.ids), summary
    assert figs.tapped and all((i.sequences or 0) <= 1 for i in figs.ids), summary
    assert all(len(i.answered_ok) <= 1 and i.served for i in figs.ids), summary
    assert not result.problems(), summary
    # The rate bucket was deducted exactly once per id.
    for bucket in figs.buckets.values():
        assert bucket.usage_requests == bucket.ids, summary
        assert abs(bucket.deductions - bucket.ids) < 1e-6, summary
    assert not figs.reconcile_differences and figs.converge_s is not None, summary
    # The history checker over every send (an SDK call with its own retries is one): one reservation per id,
    # nothing run or billed twice, billed = received, the replicas' counts agree, nothing open.
    history = figs.history
    sends = sum(1 + len(i.plan.resend_delays_s) for i in figs.ids)
    assert (history.requests, history.reservations, history.attempts) == (config.ids, config.ids, sends), summary
    assert history.discrepancies == (), history.table()
    assert result.passed, summary
    timed.assert_within(WALL_S_MAX)
