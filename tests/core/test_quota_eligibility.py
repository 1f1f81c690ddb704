"""The request quota's eligibility, read through the bracket it keeps per held tenant, is the bucket's own answer
at every instant; and the admit step's ``fill`` makes the picks and charges ``admit`` does one slot at a time."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from fairgate.core import CostModel, PolicySpec, Request, RunningView, TenantShare, make_policy
from fairgate.core.admit import Admitter
from fairgate.core.policies.quota import _ONE_REQUEST, RequestQuota
from fairgate.core.ratelimit import TokenBucket, refill


def _near(t: float, steps: int) -> list[float]:
    """``t`` and the ``steps`` floats either side of it."""
    out, x = [], t
    for _ in range(steps):
        x = math.nextafter(x, -math.inf)
    for _ in range(2 * steps + 1):
        out.append(x)
        x = math.nextafter(x, math.inf)
    return out


@settings(max_examples=400, deadline=None)
@given(
    per_minute=st.floats(0.01, 1e7),
    burst=st.sampled_from([1.0, 1.5, 2.0, 10.0]),
    level=st.one_of(st.floats(-50, 10), st.sampled_from([1 - 1e-9, 1 - 2e-9, 0.0, -0.0, 1.0])),
    updated=st.one_of(st.just(0.0), st.floats(0, 1e5), st.floats(0, 3e11)),
    offsets=st.lists(st.floats(-1e4, 1e7), min_size=1, max_size=8),
)
def test_the_bracket_answers_as_the_bucket_does(per_minute, burst, level, updated, offsets):
    quota = RequestQuota(per_minute, burst)
    bucket = TokenBucket(quota._rate_per_ms, quota._burst, level, updated)
    quota._buckets["a"] = bucket
    lo, hi = quota._bracket("a")
    closed_form = updated + (_ONE_REQUEST - level) / bucket.rate_per_ms
    instants = [updated + o for o in offsets]
    for end in (lo, hi, closed_form):
        if math.isfinite(end):
            instants += _near(end, 6)
    for now in instants:
        held = refill(bucket.level, bucket.updated_ms, now, bucket.rate_per_ms, bucket.burst)[0] >= _ONE_REQUEST
        assert (now >= hi or (now > lo and held)) == held, (now, lo, hi)


def test_a_pick_moves_the_bracket_with_the_bucket():
    quota, view = RequestQuota(60, 1), RunningView()  # one request a second
    for i in range(3):
        quota.enqueue(Request(i, "a", 10, 0.0), 0.0)
    assert quota.pick(0.0, view) is not None  # a full bucket
    assert quota.pick(999.0, view) is None  # 0.999 of a request refilled
    assert quota.pick(1000.0, view) is not None
    assert quota.pick(1500.0, view) is None
    assert quota.pick(2000.0, view) is not None


@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(["fcfs", "vtc", "gpu_fair", "request_quota", "slot_cap", "drr"]),
    prompts=st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 500)), min_size=1, max_size=12),
    free=st.integers(0, 8),
    running=st.integers(0, 4),
)
def test_fill_picks_and_charges_as_admit_does_slot_by_slot(policy, prompts, free, running):
    cost = CostModel(9, 0.55, 0.06, 24)
    shares = {t: TenantShare() for t in "abc"}
    params = {"request_quota": {"requests_per_minute": 60, "burst_requests": 2}, "slot_cap": {"max_running": 2}}
    spec = PolicySpec(policy, params)
    one, many = Admitter(make_policy(spec, cost, shares)), Admitter(make_policy(spec, cost, shares))
    for admitter in (one, many):
        for i, (tenant, prompt) in enumerate(prompts):
            admitter.enqueue(Request(i, tenant, prompt, float(i)), 0.0)
    slot_by_slot = []
    while len(slot_by_slot) < free and one.queued():
        picked = one.admit(5.0, running + len(slot_by_slot) + 1, cost)
        if picked is None:
            break
        slot_by_slot.append(picked)
    filled = many.fill(5.0, free, running, cost)
    assert [(r.request_id, ms) for r, ms in filled] == [(r.request_id, ms) for r, ms in slot_by_slot]
    assert many.view.by_tenant == one.view.by_tenant
    assert vars_of(many.policy) == vars_of(one.policy)


def vars_of(policy) -> dict:
    """A policy's state, its queues as request ids."""
    state = {}
    for name in getattr(policy, "__dict__", {}):
        value = getattr(policy, name)
        if name == "_queues":
            value = {t: [r.request_id for r in q] for t, q in value.items()}
        elif name == "_buckets":
            value = {t: (b.level, b.updated_ms) for t, b in value.items()}
        state[name] = value
    return state
