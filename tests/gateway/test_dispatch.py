"""The dispatcher on a real event loop: slots, least-loaded placement, queue bounds, fairness, cancellation."""

from __future__ import annotations

import asyncio
import time

import pytest

from fairgate.core import CostModel, PolicySpec, Request, TenantShare, make_policy
from fairgate.gateway.dispatch import Dispatcher, NoUpstream, QueueFull, Upstream

COST = CostModel(9, 0.55, 0.06, 2)


def build(policy: str = "gpu_fair", max_queued: int | None = None, params=None):  # type: ignore[no-untyped-def]
    upstreams = [Upstream("u0", "m", "http://x", 2, COST), Upstream("u1", "m", "http://y", 2, COST)]
    shares = {"a": TenantShare(), "b": TenantShare()}
    dispatcher = Dispatcher(
        lambda: make_policy(PolicySpec(policy, params or {}), COST, shares),
        upstreams,
        lambda: time.monotonic() * 1000.0,
        lambda tenant: max_queued,
    )
    return dispatcher, upstreams


async def test_slots_are_bounded_and_placement_is_least_loaded():
    dispatcher, upstreams = build()
    leases = [await dispatcher.acquire(Request(i, "a", 10, float(i)), "m") for i in range(4)]
    assert [lease.upstream.name for lease in leases] == ["u0", "u1", "u0", "u1"]
    assert [u.in_flight for u in upstreams] == [2, 2]
    waiting = asyncio.create_task(dispatcher.acquire(Request(4, "b", 10, 4.0), "m"))
    await asyncio.sleep(0.01)
    assert not waiting.done()  # every slot is taken
    dispatcher.release(leases[1])
    lease = await asyncio.wait_for(waiting, 1)
    assert lease.upstream.name == "u1" and lease.prefill_estimate_ms == pytest.approx(0.6)
    dispatcher.release(leases[1])  # releasing twice changes nothing
    assert [u.in_flight for u in upstreams] == [2, 2]


async def test_queue_bound_and_unknown_model():
    dispatcher, _ = build(max_queued=1)
    held = [await dispatcher.acquire(Request(i, "a", 10, 0.0), "m") for i in range(4)]
    queued = asyncio.create_task(dispatcher.acquire(Request(10, "a", 10, 0.0), "m"))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        await dispatcher.acquire(Request(11, "a", 10, 0.0), "m")
    other = asyncio.create_task(dispatcher.acquire(Request(12, "b", 10, 0.0), "m"))  # b has its own bound
    await asyncio.sleep(0)
    with pytest.raises(NoUpstream):
        await dispatcher.acquire(Request(13, "a", 10, 0.0), "other-model")
    for lease in held[:2]:
        dispatcher.release(lease)
    assert {(await queued).request.request_id, (await other).request.request_id} == {10, 12}


async def test_a_client_that_gives_up_while_queued_loses_its_place_not_a_slot():
    dispatcher, upstreams = build()
    held = [await dispatcher.acquire(Request(i, "a", 10, 0.0), "m") for i in range(4)]
    gone = asyncio.create_task(dispatcher.acquire(Request(20, "a", 10, 0.0), "m"))
    kept = asyncio.create_task(dispatcher.acquire(Request(21, "b", 10, 1.0), "m"))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    assert dispatcher.queued("a", "m") == 0
    dispatcher.release(held[0])
    assert (await asyncio.wait_for(kept, 1)).request.request_id == 21
    assert sum(u.in_flight for u in upstreams) == 4


@pytest.mark.parametrize(
    "holding, waiting, first",
    [
        # a has spent far more GPU time and both are active: b first, although a's requests came earlier
        pytest.param("aabb", "aabb", ["b", "b"], id="less-gpu-time-first"),
        # b was idle: lifted to a's counter, and a's request is older
        pytest.param("aaaa", "ab", ["a", "b"], id="idle-tenant-banks-no-credit"),
    ],
)
async def test_gpu_fair_order_once_a_slot_frees(holding: str, waiting: str, first: list[str]) -> None:
    """Every slot held by ``holding`` (a with 5 s of GPU time charged), ``waiting`` queued in that order:
    the first tenants served once a slot frees."""
    dispatcher, _ = build()
    held = [await dispatcher.acquire(Request(i, t, 10, 0.0), "m") for i, t in enumerate(holding)]
    dispatcher.charge("m", "a", 5000.0, 100, 4)
    order: list[str] = []

    async def wait(request: Request) -> None:
        lease = await dispatcher.acquire(request, "m")
        order.append(request.tenant)
        dispatcher.release(lease)

    tasks = [asyncio.create_task(wait(Request(10 + i, t, 10, float(i)))) for i, t in enumerate(waiting)]
    await asyncio.sleep(0)
    dispatcher.release(held[0])
    await asyncio.wait_for(asyncio.gather(*tasks), 1)
    assert order[: len(first)] == first


async def test_quota_policy_wakes_up_on_time():
    dispatcher, _ = build("request_quota", params={"request_quota": {"requests_per_minute": 600}})  # one per 100 ms
    start = time.monotonic()
    first = await dispatcher.acquire(Request(1, "a", 10, 0.0), "m")
    second = await asyncio.wait_for(dispatcher.acquire(Request(2, "a", 10, 0.0), "m"), 2)
    assert 0.08 <= time.monotonic() - start <= 0.5
    dispatcher.release(first)
    dispatcher.release(second)


async def test_a_retired_upstream_drains_its_requests_then_is_forgotten():
    dispatcher, (u0, u1) = build()
    gone: list[str] = []
    dispatcher.on_gone = lambda upstream: gone.append(upstream.name)
    running = await dispatcher.acquire(Request(0, "a", 10, 0.0), "m")  # on u0
    dispatcher.retire(u0)
    later = [await dispatcher.acquire(Request(i, "a", 10, 0.0), "m") for i in (1, 2)]
    assert [lease.upstream.name for lease in later] == ["u1", "u1"] and gone == []  # u0 takes no new one
    dispatcher.release(running)
    assert gone == ["u0"] and dispatcher.upstreams() == [u1]
    u2 = Upstream("u2", "m", "http://z", 2, COST)
    dispatcher.add(u2)
    assert (await dispatcher.acquire(Request(3, "a", 10, 0.0), "m")).upstream is u2


async def test_retiring_the_last_upstream_serving_fails_the_queued_requests_at_once():
    """The other upstream is down: taken out, the one serving leaves nobody to wait for."""
    dispatcher, (u0, u1) = build()
    dispatcher.mark_down(u1)
    held = [await dispatcher.acquire(Request(i, "a", 10, 0.0), "m") for i in range(2)]  # u0 is full
    queued = asyncio.create_task(dispatcher.acquire(Request(9, "b", 10, 0.0), "m"))
    await asyncio.sleep(0.01)
    assert not queued.done()
    dispatcher.retire(u0)
    with pytest.raises(NoUpstream):
        await asyncio.wait_for(queued, 1)
    for lease in held:
        dispatcher.release(lease)


async def test_a_held_request_no_upstream_left_can_fit_fails_and_frees_the_pool():
    """Swapped for a replica of fewer slots, the pool cannot ever hold a request of three sequences: it fails,
    and the request behind it runs."""
    dispatcher, (u0, u1) = build("fcfs")
    dispatcher.retire(u1)  # one upstream of two slots, then one of four
    big = Upstream("big", "m", "http://b", 4, COST)
    dispatcher.add(big)
    full = [await dispatcher.acquire(Request(i, "a", 10, 0.0), "m") for i in range(6)]
    triple = asyncio.create_task(dispatcher.acquire(Request(10, "a", 10, 1.0, 30, sequences=3), "m"))
    single = asyncio.create_task(dispatcher.acquire(Request(11, "b", 10, 2.0), "m"))
    await asyncio.sleep(0.01)
    assert not triple.done() and not single.done()  # the triple is held for three slots on one upstream
    dispatcher.retire(big)  # what is left has two slots
    dispatcher.release(next(lease for lease in full if lease.upstream is u0))  # the policy picks the triple
    with pytest.raises(NoUpstream):
        await asyncio.wait_for(triple, 1)
    assert (await asyncio.wait_for(single, 1)).upstream is u0


async def test_a_correction_moves_gpu_time_between_tenants_counters_and_shares_only_what_grew():
    dispatcher, _ = build()
    dispatcher.charge("m", "a", 100.0, 0, 1)
    dispatcher.charge("m", "b", 10.0, 0, 1)
    assert dispatcher.take_local_charges("m") == {"a": (100.0, 0, 0), "b": (10.0, 0, 0)}
    policy = dispatcher._pools["m"].admitter.policy  # type: ignore[attr-defined]
    before = dict(policy.counters)
    # a's cached prompt: 30 ms taken back from a, booked to b who ran beside it.
    dispatcher.correct("m", {"a": -30.0, "b": 30.0})
    assert policy.counters["a"] == pytest.approx(before["a"] - 30.0)
    assert policy.counters["b"] == pytest.approx(before["b"] + 30.0)
    # Shared totals only grow: a's -30 waits for a's next charges, b's +30 goes out at once.
    assert dispatcher.take_local_charges("m") == {"a": (0.0, 0, 0), "b": (30.0, 0, 0)}
    dispatcher.charge("m", "a", 20.0, 0, 1)
    assert dispatcher.take_local_charges("m") == {"a": (0.0, 0, 0)}  # -30 + 20: still owed
    dispatcher.charge("m", "a", 25.0, 0, 1)
    assert dispatcher.take_local_charges("m") == {"a": (pytest.approx(15.0), 0, 0)}
    assert dispatcher.take_local_charges("m") == {}
