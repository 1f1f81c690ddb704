"""Policies driven by hand, step by step, on a plain clock."""

import pytest

from fairgate.core import (
    POLICY_NAMES,
    CostModel,
    PolicySpec,
    Request,
    RunningView,
    TenantShare,
    TokenBucket,
    make_policy,
)
from fairgate.core.policies.counters import VTC, GPUFair
from fairgate.core.policies.pools import PriorityPools
from fairgate.core.policies.quota import RequestQuota, SlotCap
from fairgate.core.policies.simple import FCFS, RoundRobin

COST = CostModel(9, 0.55, 0.06, 24)


def requests(*tenants, prompt=100):
    return [Request(i, t, prompt, float(i)) for i, t in enumerate(tenants)]


def drain(policy, view=None):
    view = view or RunningView()
    out = []
    while (r := policy.pick(0.0, view)) is not None:
        out.append(r.tenant)
    return out


@pytest.mark.parametrize(
    "policy, arrivals, served",
    [
        (FCFS, "abac", "abac"),  # in arrival order
        (RoundRobin, "aaabbc", "abcaba"),  # alternating
    ],
)
def test_fcfs_and_round_robin_order(policy, arrivals, served):
    p = policy()
    for r in requests(*arrivals):
        p.enqueue(r, 0.0)
    assert drain(p) == list(served)


def test_vtc_charges_input_at_admission_and_output_twice():
    p = VTC()
    for r in requests("a", "a", "b", "b", prompt=100):
        p.enqueue(r, 0.0)
    first = p.pick(0.0, RunningView())
    p.charge(first.tenant, 6.0, 100, 0, 1)
    assert p.counters["a"] == 100
    assert p.pick(0.0, RunningView()).tenant == "b"  # a is now ahead
    p.charge("a", 1.0, 0, 10, 2)
    assert p.counters["a"] == 120


def test_counter_lift_forgives_idle_time_only_up_to_the_lowest_active():
    p = GPUFair()
    p.enqueue(Request(0, "a", 10, 0.0), 0.0)
    p.pick(0.0, RunningView())
    p.charge("a", 500.0, 10, 0, 1)
    p.enqueue(Request(1, "a", 10, 1.0), 1.0)
    p.enqueue(Request(2, "b", 10, 2.0), 2.0)  # b becomes backlogged: lifted to a's counter
    assert p.counters["b"] == 500.0
    # Ties go to the earliest head request.
    assert p.pick(3.0, RunningView()).tenant == "a"


def test_a_running_tenant_that_got_all_it_asked_does_not_bank_its_unused_weighted_share():
    """gold (weight 2) and silver, uncontended: each keeps one long request running and sends short ones
    (100 ms each) that are picked at once, so gold's counter grows half as fast as silver's. Each short
    request of gold's arrives to its empty queue while it runs: it is lifted to the virtual time less its
    running work (one request at its mean charge), so when capacity drops gold has not banked the
    difference (without the lift: 1000 behind silver after 20 rounds, and it would win the next 10 picks)."""
    p = GPUFair(weights={"gold": 2.0})
    view = RunningView()
    for rid, tenant in enumerate(("gold", "silver")):  # the long requests
        p.enqueue(Request(rid, tenant, 10, 0.0), 0.0)
        p.pick(0.0, view)
    rid = 2
    for _ in range(20):
        for tenant in ("gold", "silver"):
            p.enqueue(Request(rid, tenant, 10, 0.0), 0.0)
            picked = p.pick(0.0, view)
            assert picked is not None and picked.tenant == tenant  # uncontended: picked at once
            p.charge(tenant, 100.0, 0, 0, 2)
            p.finish(picked, 0.0)
            rid += 1
    assert p.counters["silver"] == pytest.approx(2000.0)
    # Gold's last request was lifted to the virtual time (silver's key at its last pick: 1800) less gold's
    # allowance (50), then charged its 50: 200 behind silver, where it was 1000 behind without the lift.
    assert p.counters["gold"] == pytest.approx(1800.0)
    # Capacity drops: both backlogged; gold's key is not far below silver's any more.
    p.enqueue(Request(rid, "gold", 10, 0.0), 0.0)
    p.enqueue(Request(rid + 1, "silver", 10, 0.0), 0.0)
    picks = []
    for _ in range(2):
        picked = p.pick(0.0, view)
        picks.append(picked.tenant)
        p.charge(picked.tenant, 100.0, 0, 0, 2)
    assert sorted(picks) == ["gold", "silver"]


def test_a_running_tenant_is_not_lifted_before_any_of_its_requests_finished():
    """Its running work cannot be estimated yet (seed 002's agent at start-up would pay it twice)."""
    p = GPUFair()
    p.enqueue(Request(0, "a", 10, 0.0), 0.0)
    p.enqueue(Request(1, "b", 10, 0.0), 0.0)
    view = RunningView()
    p.pick(0.0, view)
    p.pick(0.0, view)
    p.charge("a", 300.0, 0, 0, 2)
    p.enqueue(Request(2, "b", 10, 0.0), 0.0)  # b runs, queue empty, key 0 < virtual time; nothing finished
    assert p.counters.get("b", 0.0) == 0.0


def test_weights_scale_counters():
    p = GPUFair(weights={"a": 2.0})
    p.charge("a", 100.0, 0, 0, 1)
    p.charge("b", 100.0, 0, 0, 1)
    assert p.counters == {"a": 50.0, "b": 100.0}


def test_request_quota_holds_and_wakes():
    p = RequestQuota(requests_per_minute=60, burst_requests=1)  # one per second
    for r in requests("a", "a"):
        p.enqueue(r, 0.0)
    assert p.pick(0.0, RunningView()).request_id == 0
    assert p.pick(10.0, RunningView()) is None
    wake = p.wake_at(10.0)
    assert wake == pytest.approx(1000.0, abs=1e-6)
    assert p.pick(wake, RunningView()).request_id == 1


def test_slot_cap_respects_running_count():
    p = SlotCap(max_running=1)
    for r in requests("a", "a", "b"):
        p.enqueue(r, 0.0)
    view = RunningView({"a": 1})
    assert p.pick(0.0, view).tenant == "b"
    assert p.pick(0.0, RunningView({"a": 1, "b": 1})) is None


def test_priority_pools_serve_interactive_first():
    p = PriorityPools({"i": "interactive", "b": "batch"}, FCFS)
    p.enqueue(Request(0, "b", 1, 0.0), 0.0)
    p.enqueue(Request(1, "i", 1, 1.0), 1.0)
    assert drain(p) == ["i", "b"]


def test_factory_builds_every_policy_and_rejects_unknown():
    shares = {"a": TenantShare(), "b": TenantShare(2.0)}
    params = {
        "request_quota": {"requests_per_minute": 10},
        "token_quota": {"tokens_per_minute": 1000},
        "slot_cap": {"max_running": 2},
    }
    assert len(POLICY_NAMES) == 9
    for name in POLICY_NAMES:
        assert make_policy(PolicySpec(name, params), COST, shares).name == name
    with pytest.raises(ValueError, match="unknown policy 'fifo'"):
        make_policy(PolicySpec("fifo"), COST, shares)


def test_token_bucket_caps_burst_and_books_debt():
    bucket = TokenBucket(rate_per_ms=1.0, burst=10.0)
    assert bucket.available(1_000_000.0) == 10.0  # a long idle time never banks more than the burst
    bucket.spend(10.0, 5.0)
    bucket.book(5.0)
    assert bucket.available(5.0) == -5.0
    assert bucket.ready_at(3.0, 5.0) == 13.0


def test_gpu_fair_counts_a_running_requests_declared_output_as_committed_work():
    from fairgate.core.cost import CostModel
    from fairgate.core.policies.counters import GPUFair
    from fairgate.core.request import Request, RunningView

    cost = CostModel(9.0, 0.55, 0.06, 24)
    per_token_ms = cost.decode_ms(24) / 24  # 0.925 ms
    policy = GPUFair(cost=cost, commit_horizon_tokens=100_000)  # commit the whole declared output
    for i in range(20):
        policy.enqueue(Request(2 * i, "agent", 10, float(i), max_output_tokens=8000), float(i))
        policy.enqueue(Request(2 * i + 1, "chat", 10, float(i), max_output_tokens=20), float(i))
    view = RunningView()
    picks = [policy.pick(100.0, view) for _ in range(12)]
    # One 8k-token agent request commits 7.4 s of decode: the chat tenant takes the next slots, where plain
    # charge-as-spent counters (both at 0) would alternate and hand the agent half of the slots.
    assert [r.tenant for r in picks] == ["agent"] + ["chat"] * 11
    assert policy.committed["agent"] == pytest.approx(8000 * per_token_ms)
    policy.charge("agent", 50.0, 0, 40, 24)  # 40 tokens generated: 40 fewer committed
    assert policy.committed["agent"] == pytest.approx(7960 * per_token_ms)
    assert policy.counters["agent"] == pytest.approx(50.0)  # the counter moves by what was spent only
    # Tokens another gateway process's requests generated move the counter, not this process's commitments.
    policy.charge("agent", 30.0, 0, 500, 24, remote=True)
    assert policy.committed["agent"] == pytest.approx(7960 * per_token_ms)
    assert policy.counters["agent"] == pytest.approx(80.0)
    agent = picks[0]
    agent.generated_tokens = 40  # it stopped after those 40 tokens: the rest of its commitment goes
    policy.finish(agent, 200.0)
    assert policy.committed["agent"] == pytest.approx(0.0, abs=1e-9)
    capped = GPUFair(cost=cost)  # the default horizon: a pick commits at most 96 tokens (88.8 ms)
    for i in range(8):
        capped.enqueue(Request(2 * i, "agent", 10, float(i), max_output_tokens=8000), float(i))
        capped.enqueue(Request(2 * i + 1, "chat", 10, float(i), max_output_tokens=20), float(i))
    # chat commits 20 tokens (18.5 ms) a pick: five chat picks pass the agent's one.
    assert [capped.pick(100.0, view).tenant for _ in range(7)] == ["agent"] + ["chat"] * 5 + ["agent"]
    with pytest.raises(ValueError, match="commit_horizon_tokens"):
        GPUFair(cost=cost, commit_horizon_tokens=-1)
    without = GPUFair()  # no cost model: nothing committed, as before
    for i in range(4):
        without.enqueue(Request(2 * i, "agent", 10, float(i), max_output_tokens=8000), float(i))
        without.enqueue(Request(2 * i + 1, "chat", 10, float(i), max_output_tokens=20), float(i))
    assert [without.pick(100.0, view).tenant for _ in range(4)] == ["agent", "chat", "agent", "chat"]
