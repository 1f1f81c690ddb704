"""A configuration reload's new weights and tenants on running policies (``factory.reshare``): what a tenant
accrued stays, what it is charged next is divided by its new weight, and what only a restart can apply (a
pool move) is refused before anything changes."""

from __future__ import annotations

import pytest

from fairgate.core.cost import CostModel
from fairgate.core.policies.counters import VTC, GPUFair
from fairgate.core.policies.drr import DeficitRoundRobin
from fairgate.core.policies.factory import PolicySpec, TenantShare, make_policy, reshare
from fairgate.core.policies.pools import PriorityPools
from fairgate.core.request import Request, RunningView

COST = CostModel(iter_base_ms=4.0, iter_slope_ms=0.25, prefill_ms_per_token=0.01, max_batch=8)
EVEN = {"alpha": TenantShare(1.0), "beta": TenantShare(1.0)}


def test_a_new_weight_divides_the_charges_from_then_on_and_the_counter_keeps_what_it_accrued() -> None:
    policy = make_policy(PolicySpec("gpu_fair"), COST, EVEN)
    assert isinstance(policy, GPUFair)
    policy.charge("beta", 30.0, 0, 1, 1)
    accrued = policy.counters["beta"]
    assert accrued == pytest.approx(30.0)
    reshare(policy, {**EVEN, "beta": TenantShare(3.0), "delta": TenantShare(2.0)})
    assert policy.weights == {"alpha": 1.0, "beta": 3.0, "delta": 2.0}
    assert policy.counters["beta"] == accrued  # the service already weighed stands
    for tenant in ("alpha", "beta", "delta"):
        policy.charge(tenant, 30.0, 0, 1, 1)
    assert policy.counters["alpha"] == pytest.approx(30.0)
    assert policy.counters["beta"] == pytest.approx(accrued + 10.0)
    assert policy.counters["delta"] == pytest.approx(15.0)


def test_drr_gives_a_reweighted_tenant_its_new_quantum() -> None:
    policy = make_policy(PolicySpec("drr", {"drr": {"quantum_ms": 10.0}}), COST, EVEN)
    assert isinstance(policy, DeficitRoundRobin)
    reshare(policy, {"alpha": TenantShare(1.0), "beta": TenantShare(4.0)})
    assert policy.weights == {"alpha": 1.0, "beta": 4.0}
    for i, tenant in enumerate(("alpha", "beta", "beta")):  # beta stays backlogged after its pick
        policy.enqueue(Request(i + 1, tenant, 1, 0.0, 1), 0.0)
    picked = policy.pick(0.0, RunningView())
    # beta's first visit comes before alpha's (it is second in the rotation) and gives it 4 quanta, not 1.
    assert picked is not None and picked.tenant == "beta"
    assert policy.deficits == {"alpha": 0.0, "beta": 40.0}


def test_priority_pools_route_new_tenants_and_refuse_a_move_before_changing_anything() -> None:
    tenants = {"alpha": TenantShare(1.0, "interactive"), "beta": TenantShare(1.0, "batch")}
    policy = make_policy(PolicySpec("gpu_fair"), COST, tenants)
    assert isinstance(policy, PriorityPools)
    reshare(policy, {**tenants, "gamma": TenantShare(2.0, "batch")})
    assert policy.priority_of("gamma") == "batch"
    assert [p.weights for p in policy.pools if isinstance(p, GPUFair)] == [
        {"alpha": 1.0, "beta": 1.0, "gamma": 2.0}
    ] * 2
    with pytest.raises(ValueError, match="'beta': priority 'interactive' is applied by a restart only"):
        reshare(policy, {**tenants, "beta": TenantShare(5.0, "interactive")})
    with pytest.raises(ValueError, match="'delta': priority 'eval'"):
        reshare(policy, {**tenants, "delta": TenantShare(1.0, "eval")})  # no eval pool in use
    assert policy.priority_of("beta") == "batch" and policy.priority_of("delta") == "interactive"
    assert [p.weights["beta"] for p in policy.pools if isinstance(p, GPUFair)] == [1.0, 1.0]


def test_one_pool_in_use_refuses_a_second_priority_and_a_weight_not_above_zero() -> None:
    policy = make_policy(PolicySpec("vtc"), COST, EVEN)
    with pytest.raises(ValueError, match="more than one priority pool"):
        reshare(policy, {**EVEN, "gamma": TenantShare(1.0, "batch")})
    with pytest.raises(ValueError, match="weight of tenant 'beta' must be > 0"):
        reshare(policy, {**EVEN, "beta": TenantShare(0.0)})
    reshare(policy, {"alpha": TenantShare(1.0, "batch"), "beta": TenantShare(2.0, "batch")})  # one pool still
    assert isinstance(policy, VTC) and policy.weights == {"alpha": 1.0, "beta": 2.0}
    fcfs = make_policy(PolicySpec("fcfs"), COST, EVEN)
    reshare(fcfs, {**EVEN, "beta": TenantShare(7.0)})  # no weights to apply: nothing to refuse either
