"""The two engines agree exactly, and both keep the charge rule's invariants (hypothesis properties)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fairgate.core import POLICY_NAMES, CostModel, PolicySpec, TenantShare, make_policy
from fairgate.sim.distributions import Fixed, LogNormal
from fairgate.sim.engine_compressed import run_compressed
from fairgate.sim.engine_reference import run_reference
from fairgate.sim.generate import TenantLoad, poisson_workload
from fairgate.sim.result import NOT_YET, SimResult
from fairgate.sim.workload import Workload

PARAMS = {
    "request_quota": {"requests_per_minute": 300, "burst_requests": 2},
    "token_quota": {"tokens_per_minute": 40_000},
    "slot_cap": {"max_running": 3},
    "drr": {"quantum_ms": 20.0},
}


@st.composite
def scenarios(draw):
    cost = CostModel(
        draw(st.sampled_from([2.0, 9.0, 15.5])),
        draw(st.sampled_from([0.0, 0.25, 0.55])),
        draw(st.sampled_from([0.0, 0.01, 0.06])),
        draw(st.integers(1, 12)),
    )
    count = draw(st.integers(1, 4))
    tenants, shares = [], {}
    for k in range(count):
        prompt = Fixed(draw(st.integers(0, 600)))
        output = draw(
            st.one_of(st.builds(Fixed, st.integers(1, 60)), st.builds(LogNormal, st.floats(2, 150), st.floats(0, 1.5)))
        )
        name = f"t{k}"
        tenants.append(TenantLoad(name, prompt, output, draw(st.floats(50, 1500))))
        shares[name] = TenantShare(
            draw(st.sampled_from([1.0, 1.0, 2.0, 0.5])), draw(st.sampled_from(["interactive", "interactive", "batch"]))
        )
    replicas = draw(st.integers(1, 3))
    policy = draw(st.sampled_from(POLICY_NAMES))
    assume(policy != "vtc_calibrated" or cost.prefill_ms_per_token > 0)
    seed = draw(st.integers(0, 10_000))
    duration_s = draw(st.sampled_from([0.5, 2.0, 5.0]))
    drain = draw(st.booleans())
    return cost, tenants, shares, replicas, policy, seed, duration_s, drain


def both(cost, tenants, shares, replicas, policy, seed, duration_s, drain=False) -> tuple[SimResult, SimResult]:
    workload = poisson_workload(cost, tenants, duration_s, seed)
    spec = PolicySpec(policy, PARAMS)
    reference = run_reference(workload, cost, make_policy(spec, cost, shares), replicas, drain=drain)
    compressed = run_compressed(workload, cost, make_policy(spec, cost, shares), replicas, drain=drain)
    return reference, compressed


def assert_same(a: SimResult, b: SimResult) -> None:
    assert a.admissions == b.admissions
    assert a.admit_ns == b.admit_ns
    assert a.first_token_ns == b.first_token_ns
    assert a.finish_ns == b.finish_ns
    assert a.generated_tokens == b.generated_tokens
    assert a.busy_ns == b.busy_ns
    assert a.iterations == b.iterations
    assert a.tenant_decode_tokens == b.tenant_decode_tokens
    assert a.request_gpu_ms == pytest.approx(b.request_gpu_ms, rel=1e-9, abs=1e-9)
    assert a.tenant_gpu_ms == pytest.approx(b.tenant_gpu_ms, rel=1e-9, abs=1e-9)


def assert_invariants(result: SimResult, cost: CostModel) -> None:
    workload = result.workload
    # Charges sum to busy time, per tenant and per request.
    assert result.charged_ms == pytest.approx(result.busy_ms, rel=1e-9, abs=1e-9)
    assert sum(result.request_gpu_ms) == pytest.approx(result.busy_ms, rel=1e-9, abs=1e-9)
    # No request is admitted twice; every finished one generated exactly its output tokens.
    ids = [i for i, _, _ in result.admissions]
    assert len(ids) == len(set(ids))
    for i in range(len(workload)):
        if result.finish_ns[i] != NOT_YET:
            assert result.generated_tokens[i] == workload.output_tokens[i]
            assert result.admit_ns[i] != NOT_YET and result.admit_ns[i] >= workload.arrival_ns[i]
        if result.admit_ns[i] == NOT_YET:
            assert result.generated_tokens[i] == 0
        else:
            assert result.first_token_ns[i] > result.admit_ns[i]
    assert sum(result.generated_tokens) == sum(result.tenant_decode_tokens)
    # Slots never exceed max_batch on any replica.
    events: list[tuple[int, int, int]] = []
    for i, replica, t in result.admissions:
        events.append((t, 1, replica))
        if result.finish_ns[i] != NOT_YET:
            events.append((result.finish_ns[i], 0, replica))  # a finish frees its slot before admissions
    running = [0] * result.replicas
    for _, delta, replica in sorted(events):
        running[replica] += 1 if delta else -1
        assert 0 <= running[replica] <= cost.max_batch


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_engines_agree_and_keep_invariants(case):
    cost = case[0]
    reference, compressed = both(*case)
    assert_same(reference, compressed)
    assert_invariants(reference, cost)
    assert_invariants(compressed, cost)
    if case[-1]:  # a drained run ends with every request finished: no policy here holds one for ever
        assert NOT_YET not in compressed.finish_ns
        assert compressed.generated_tokens == compressed.workload.output_tokens


@pytest.mark.parametrize("policy", ["fcfs", "gpu_fair", "request_quota"])
def test_a_drained_run_finishes_what_a_cut_run_leaves_and_agrees_up_to_the_cut(policy, seed_scenario):
    from fairgate.sim.experiment import simulate

    workload = poisson_workload(seed_scenario.cost, seed_scenario.tenants, 20, 3)
    cut = simulate(seed_scenario, workload, policy)
    drained = simulate(seed_scenario, workload, policy, drain=True)
    reference = simulate(seed_scenario, workload, policy, "reference", drain=True)
    assert_same(reference, drained)
    unfinished = [i for i, f in enumerate(cut.finish_ns) if f == NOT_YET]
    assert len(unfinished) > 50  # the seed scenario is overloaded: a cut leaves many behind
    assert NOT_YET not in drained.finish_ns
    assert max(drained.finish_ns) > workload.duration_ns
    # Up to the cut the two runs are the same run: every admission before the window's end matches.
    end = workload.duration_ns
    assert [a for a in drained.admissions if a[2] < end] == cut.admissions
    assert drained.charged_ms == pytest.approx(drained.busy_ms, rel=1e-9)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_engines_agree_on_seed_scenario(policy, seed_scenario):
    from fairgate.sim.experiment import simulate

    workload = poisson_workload(seed_scenario.cost, seed_scenario.tenants, 30, 7)
    reference = simulate(seed_scenario, workload, policy, "reference")
    compressed = simulate(seed_scenario, workload, policy, "compressed")
    assert len(reference.admissions) > 100
    assert_same(reference, compressed)
    assert_invariants(compressed, seed_scenario.cost)


def test_iteration_timing_follows_the_convention():
    # One request, 3 output tokens, alone: prefilled in its first iteration, resident for 3.
    cost = CostModel(10, 1, 0.5, 4)
    workload = Workload(
        ["a"],
        arrival_ns=[1_500_000],
        tenant_index=[0],
        prompt_tokens=[20],
        output_tokens=[3],
        duration_ns=5_000_000_000,
    )
    spec = PolicySpec("fcfs")
    for engine in (run_reference, run_compressed):
        result = engine(workload, cost, make_policy(spec, cost, {"a": TenantShare()}))
        t0 = workload.arrival_ns[0]
        assert result.admit_ns[0] == t0  # an idle replica starts at the arrival instant
        assert result.first_token_ns[0] == t0 + 11_000_000 + 10_000_000  # dt(B=1) + prefill of 20 tokens
        assert result.finish_ns[0] == t0 + 21_000_000 + 2 * 11_000_000
        assert result.busy_ms == pytest.approx(43.0)
        assert result.request_gpu_ms[0] == pytest.approx(43.0)
