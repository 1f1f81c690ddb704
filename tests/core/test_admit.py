"""The admit step both drivers run (``fairgate.core.admit``), and ``Policy.remove``."""

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fairgate.core import POLICY_NAMES, CostModel, PolicySpec, Request, TenantShare, make_policy
from fairgate.core.admit import Admitter
from fairgate.core.policies.counters import GPUFair
from fairgate.core.policies.pools import PriorityPools
from fairgate.core.policies.simple import FCFS
from fairgate.gateway.dispatch import Dispatcher, Lease, Upstream

COST = CostModel(9, 0.55, 0.06, 24)


def test_admit_counts_the_request_running_and_charges_its_prefill():
    admitter = Admitter(GPUFair())
    admitter.enqueue(Request(1, "a", 100, 0.0), 0.0)
    admitter.enqueue(Request(2, "a", 50, 0.0), 0.0)
    assert admitter.queued("a") == 2 and admitter.queued() == 2
    request, prefill_ms = admitter.admit(0.0, 1, COST)
    assert request.request_id == 1 and prefill_ms == pytest.approx(6.0)  # 100 tokens x 0.06 ms
    assert admitter.policy.counters["a"] == pytest.approx(6.0)
    assert admitter.running_by_tenant() == {"a": 1} and admitter.queued_by_tenant() == {"a": 1}
    admitter.finish(request, 10.0, generated_tokens=7)
    assert request.generated_tokens == 7 and admitter.running_by_tenant() == {}


def test_a_refused_pick_is_finished_unrun_and_uncharged():
    admitter = Admitter(GPUFair())
    for i, tenant in enumerate(("a", "b")):
        admitter.enqueue(Request(i, tenant, 100, float(i)), float(i))
    request, _ = admitter.admit(0.0, 1, COST, accept=lambda r: r.tenant != "a")
    assert request.tenant == "b"
    assert admitter.policy.counters.get("a", 0.0) == 0.0 and admitter.policy.counters["b"] == pytest.approx(6.0)
    assert admitter.running_by_tenant() == {"b": 1} and admitter.queued() == 0
    assert admitter.admit(0.0, 2, COST) is None


def test_remove_takes_a_queued_request_out_and_the_others_keep_their_order():
    admitter = Admitter(FCFS())
    for i, tenant in enumerate(("a", "b", "a", "c")):
        admitter.enqueue(Request(i, tenant, 10, float(i)), float(i))
    removed = admitter.remove(2, 5.0)
    assert removed is not None and (removed.request_id, removed.tenant) == (2, "a")
    assert admitter.remove(2, 5.0) is None  # not queued any more
    assert admitter.queued_by_tenant() == {"a": 1, "b": 1, "c": 1}
    picked = [admitter.admit(6.0, 1, COST) for _ in range(3)]
    assert [p[0].request_id for p in picked if p is not None] == [0, 1, 3]
    assert admitter.admit(6.0, 1, COST) is None


def test_a_tenant_removed_from_its_queue_is_idle_and_its_counter_is_the_floor_for_the_next():
    policy = GPUFair()
    admitter = Admitter(policy)
    admitter.enqueue(Request(0, "a", 100, 0.0), 0.0)
    picked = admitter.admit(0.0, 1, COST)
    assert picked is not None
    admitter.finish(picked[0], 1.0, 1)  # a's counter: 6 ms
    admitter.enqueue(Request(1, "a", 100, 2.0), 2.0)
    assert admitter.remove(1, 3.0) is not None  # a leaves: nothing queued, nothing running
    admitter.enqueue(Request(2, "b", 100, 4.0), 4.0)
    assert policy.counters["b"] == pytest.approx(6.0)  # lifted to the last tenant that went idle


def test_priority_pools_remove_from_the_pool_that_holds_the_request():
    pools = PriorityPools({"i": "interactive", "b": "batch"}, FCFS)
    pools.enqueue(Request(0, "b", 10, 0.0), 0.0)
    pools.enqueue(Request(1, "i", 10, 1.0), 1.0)
    assert pools.remove(0, 2.0) is not None and pools.queued() == 1
    assert pools.remove(7, 2.0) is None


SPEC_PARAMS = {
    "slot_cap": {"max_running": 2},
    "request_quota": {"requests_per_minute": 60, "burst_requests": 3},
    "token_quota": {"tokens_per_minute": 6000, "burst_tokens": 5000},
}


async def _settle() -> None:
    """Let the tasks granted a slot finish and their callbacks run (a few loop iterations)."""
    for _ in range(3):
        await asyncio.sleep(0)


def _policy(policy_name: str, prompts: list[tuple[str, int]]):  # type: ignore[no-untyped-def]
    shares = {t: TenantShare() for t, _ in prompts}
    return make_policy(PolicySpec(policy_name, SPEC_PARAMS), COST, shares)


def _drive_admitter(policy_name: str, prompts: list[tuple[str, int]], slots: int) -> list[int]:
    """Requests arrive one after another, each admitted at once while a slot is free; then one finish and
    one admission at a time (each finishing request generates ``10 + its id`` tokens, charged at the batch
    it ran in)."""
    admitter = Admitter(_policy(policy_name, prompts))
    running: list[Request] = []
    order: list[int] = []

    def fill() -> None:
        while len(running) < slots and (picked := admitter.admit(0.0, len(running) + 1, COST)) is not None:
            running.append(picked[0])
            order.append(picked[0].request_id)

    for i, (tenant, prompt) in enumerate(prompts):
        admitter.enqueue(Request(i, tenant, prompt, 0.0, 64), 0.0)
        fill()
    while running:
        done = running.pop(0)
        tokens = 10 + done.request_id
        admitter.charge(done.tenant, tokens * COST.decode_charge_ms(len(running) + 1), 0, tokens, len(running) + 1)
        admitter.finish(done, 0.0, tokens)
        fill()
    return order


async def _drive_dispatcher(policy_name: str, prompts: list[tuple[str, int]], slots: int) -> list[int]:
    """The same sequence through the gateway's dispatcher (one upstream of ``slots`` slots)."""
    upstream = Upstream("u", "m", "http://127.0.0.1:9/v1", slots, COST)
    dispatcher = Dispatcher(lambda: _policy(policy_name, prompts), [upstream], lambda: 0.0, lambda tenant: None)
    running: list[Lease] = []  # in the order the slots were granted
    waits = []
    for tenant, prompt in prompts:
        wait = asyncio.ensure_future(dispatcher.acquire(dispatcher.request(tenant, prompt, 64), "m"))
        wait.add_done_callback(lambda done: done.cancelled() or running.append(done.result()))
        waits.append(wait)
    await _settle()
    order = [lease.request.request_id - 1 for lease in running]  # the dispatcher numbers requests from 1
    while running:
        done = running.pop(0)
        tokens = 10 + done.request.request_id - 1
        batch = len(running) + 1
        dispatcher.charge("m", done.request.tenant, tokens * COST.decode_charge_ms(batch), tokens, batch)
        dispatcher.release(done, tokens)
        await _settle()
        order.extend(lease.request.request_id - 1 for lease in running if lease.request.request_id - 1 not in order)
    for wait in waits:
        wait.cancel()
    return order


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(POLICY_NAMES),
    st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(1, 4000)), min_size=1, max_size=14),
    st.integers(1, 4),
)
def test_the_simulator_and_the_gateway_admit_the_same_requests_in_the_same_order(policy_name, prompts, slots):
    """One admit step, two drivers: a plain drive of the admitter and the gateway's dispatcher pick alike
    (arrivals and finishes in the same order, the same charges)."""
    assert asyncio.run(_drive_dispatcher(policy_name, prompts, slots)) == _drive_admitter(policy_name, prompts, slots)
