"""Drill ``ultra_long`` (fairgate.drills.ultra_long): an agent tenant's 8k-token requests (none ends within
the run) beside three backlogged tenants; the agent must get no more than its GPU share, and its agent-run
limits (``x-fairgate-run-id``, ``max_model_calls`` per run) must hold.

One run: a real stack driven by the ``openai`` client for 20 s, about 23 s of wall time.

Measured: gpu_fair gives the agent about 22 % (share 25 %), the others about 26 % each; fcfs gives the
agent about 78 % (the claim fails there, so this test can fail). Before gpu_fair counted committed work the
agent took 46-65 %."""

from __future__ import annotations

import pytest

from fairgate.drills import DrillOptions
from fairgate.drills.ultra_long import UltraLongConfig, run
from tests.conftest import timing_claims_hold_here
from tests.drills.conftest import assert_closed_loop_history, timed_run

WALL_S_MAX = 45.0


@pytest.mark.serial  # timing-sensitive: runs alone after the parallel part of the suite (scripts/test)
def test_agent_with_8k_outputs_gets_no_more_than_its_share_and_its_run_limits_hold():
    timed = timed_run(run, DrillOptions(policy="gpu_fair", compare=None))
    result, summary = timed.result, timed.summary
    config, figs = UltraLongConfig(), result.main
    checks = result.checks()
    agent = figs.tenants[config.agent]
    # The agent ran its 8k-token requests and nobody else saw an error.
    assert agent.ledger_output_tokens > 0 and checks["no other errors"], summary
    assert all(t.clients.completed > 0 for name, t in figs.tenants.items() if name != config.agent), summary
    # Agent-run limits: the ledger admitted no run more than max_model_calls calls, nor more tokens.
    assert len(figs.runs.calls) == config.agent_runs, summary
    assert figs.runs.most_calls <= config.max_model_calls, summary
    assert max(figs.runs.tokens.values()) <= config.run_max_tokens, summary
    # The history checker, over every request the clients sent: no id reserved, run or billed twice, billed =
    # received (each stream the load's end hung up on read at most 8 tokens short of what was billed), the
    # replicas generated what was billed (plus at most 64 per stream cut), nothing open or running.
    assert_closed_loop_history(figs.history, sum(t.clients.requests for t in figs.tenants.values()))
    assert checks[next(k for k in checks if k.startswith("history checker"))], summary
    # That a run reached its limit and was refused the rest depends on how far the load got.
    timing_claims_hold_here("that the run limit was reached, the share claim and the wall time")
    assert figs.runs.most_calls == config.max_model_calls and figs.runs.refused > 0, summary
    timed.assert_within(WALL_S_MAX)
    # The share claim: nobody over its share (+3 pp), the agent included.
    assert agent.share <= config.fair_share(config.agent) + config.agent_margin, summary
    assert all(t.share <= config.fair_share(name) + config.agent_margin for name, t in figs.tenants.items()), summary
    assert result.passed, summary
