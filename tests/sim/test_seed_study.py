"""Seed 002's study, reproduced: the bands of issue 2 on scenarios/seed.toml over seeds 1-5."""

from __future__ import annotations

import pytest

from fairgate.core import POLICY_NAMES
from fairgate.sim.experiment import policy_ratio, run_policy
from fairgate.sim.generate import poisson_workload

SEEDS = [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def study(seed_scenario):
    workloads = {s: poisson_workload(seed_scenario.cost, seed_scenario.tenants, 120, s) for s in SEEDS}
    return {p: run_policy(seed_scenario, p, SEEDS, workloads=workloads).mean for p in POLICY_NAMES}


def test_fcfs_band(study):
    assert 1.05 <= study["fcfs"].max_min_ratio <= 1.35


def test_request_quota_band(study):
    assert 5.0 <= study["request_quota"].max_min_ratio <= 8.0
    shares = [t.gpu_share for t in study["request_quota"].tenants]
    assert shares == sorted(shares)  # the longer the outputs, the larger the share


def test_vtc_band(study):
    assert 2.7 <= study["vtc"].max_min_ratio <= 3.4


def test_gpu_fair_band_and_decode_tokens(study):
    assert study["gpu_fair"].max_min_ratio <= 1.02
    assert study["gpu_fair"].decode_tokens >= study["fcfs"].decode_tokens


def test_slot_cap_band_and_prefill(study):
    run = study["slot_cap"]
    assert 1.7 <= run.max_min_ratio <= 2.2
    assert 0.28 <= run.prefill_fraction <= 0.34
    classify = next(t for t in run.tenants if t.name == "classify")
    assert 0.16 <= classify.prefill_ms / run.busy_ms <= 0.21


def test_charges_add_up_to_busy_time(study):
    for run in study.values():
        assert run.charged_ms == pytest.approx(run.busy_ms, rel=1e-9)
        assert sum(t.gpu_share for t in run.tenants) == pytest.approx(1.0, rel=1e-9)


def test_realised_output_lengths_match_the_seed(study):
    means = {t.name: t.mean_output_tokens for t in study["fcfs"].tenants}
    assert means["classify"] == pytest.approx(23.7, rel=0.05)
    assert means["agent"] == pytest.approx(353.8, rel=0.05)


def test_flooding_the_agent(seed_scenario):
    seeds = [1, 2, 3]
    at = {
        f: {
            p: run_policy(seed_scenario, p, seeds, {"agent": f}).mean.max_min_ratio for p in ("fcfs", "vtc", "gpu_fair")
        }
        for f in (1.0, 8.0)
    }
    assert at[1.0]["fcfs"] < 1.35 and 6.5 <= at[8.0]["fcfs"] <= 9.0  # FIFO decays with the flood
    assert 2.6 <= at[8.0]["vtc"] <= 3.5  # VTC stays near 3
    assert at[8.0]["gpu_fair"] <= 1.02 and at[1.0]["gpu_fair"] <= 1.03


def test_the_sweeps_lean_ratio_is_the_summarys_to_the_bit(study, seed_scenario):
    """``policy_ratio`` (what ``fairgate sweep`` keeps of a run) computes max/min alone, as ``summarise`` does."""
    workloads = [poisson_workload(seed_scenario.cost, seed_scenario.tenants, 120, s) for s in SEEDS]
    for policy in POLICY_NAMES:
        assert policy_ratio(seed_scenario, policy, workloads) == study[policy].max_min_ratio, policy
