"""``n`` > 1 on chat and completions: ``n`` sequences take ``n`` slots, are metered and billed as ``n``.

End to end over real HTTP on loopback (the real ``openai`` client, the gateway, an emulated replica, an
SQLite ledger), and the two parts that count the slots: the live meter and the dispatcher."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import openai
import pytest

from fairgate.core import CostModel, PolicySpec, Request, TenantShare, make_policy
from fairgate.core.meter import LiveMeter
from fairgate.emulator.api import create_app, replica_of
from fairgate.gateway.dispatch import Dispatcher, Upstream
from fairgate.gateway.observe import Dispatched
from tests.gateway.conftest import EMULATOR, REPLICA, Recorder, serve_stack

MESSAGES = [{"role": "user", "content": "say something"}]  # 2 words + 3 for the message: 5 prompt tokens


def test_n2_chat_returns_two_choices_billed_as_their_sum(tmp_path: Path) -> None:
    emulator = create_app(EMULATOR)
    with serve_stack(tmp_path, upstream=emulator) as stack:
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.keys["alpha"], max_retries=0)
        reply = client.chat.completions.create(
            model="emu", messages=MESSAGES, n=2, max_tokens=6, seed=7, extra_headers={"x-request-id": "n2"}
        )
        [reservation] = stack.reservations()
        replica = replica_of(emulator)
        finished, iterations = replica.sequences_finished, list(replica.iterations)
    assert [c.index for c in reply.choices] == [0, 1]
    per_choice = [len((c.message.content or "").split()) for c in reply.choices]
    assert all(1 <= n <= 6 for n in per_choice)
    assert reply.usage.completion_tokens == sum(per_choice) and reply.usage.prompt_tokens == 5
    # Reserved for both sequences, billed their sum; the prompt once.
    assert reservation.max_output_tokens == 12
    assert (reservation.billed.input_tokens, reservation.billed.output_tokens) == (5, sum(per_choice))
    # The replica ran two sequences side by side, the shared prompt prefilled once.
    assert finished == 2
    assert iterations[0].batch == 2 and iterations[0].prefill_tokens == 5


def test_n2_streamed_completion_relays_both_indexes(stack) -> None:  # type: ignore[no-untyped-def]
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.keys["beta"], max_retries=0)
    stream = client.completions.create(
        model="emu", prompt="a b c", n=2, max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    tokens = {0: 0, 1: 0}
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            tokens[choice.index] += bool(choice.text)
        usage = chunk.usage or usage
    [reservation] = stack.reservations()
    assert usage is not None and usage.completion_tokens == tokens[0] + tokens[1]
    assert min(tokens.values()) >= 1
    assert reservation.status == "settled" and reservation.billed.output_tokens == tokens[0] + tokens[1]


def test_n_beyond_an_upstreams_batch_or_below_one_is_400(stack) -> None:  # type: ignore[no-untyped-def]
    for n in (REPLICA.max_batch + 1, 0, "2"):
        reply = httpx.post(
            f"{stack.url}/v1/chat/completions",
            json={"model": "emu", "messages": MESSAGES, "n": n},
            headers={"Authorization": f"Bearer {stack.keys['alpha']}"},
            timeout=30,
        )
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "n", reply.text
    assert stack.reservations() == []


def test_n_sequences_wait_for_n_free_slots(tmp_path: Path) -> None:
    recorder = Recorder()
    emulator = create_app(EMULATOR)
    with serve_stack(tmp_path, upstream=emulator, observers=[recorder]) as stack:

        async def run() -> None:
            async with httpx.AsyncClient(timeout=60) as http:

                def post(tenant: str, rid: str, body: dict[str, object]) -> object:
                    headers = {"Authorization": f"Bearer {stack.keys[tenant]}", "x-request-id": rid}
                    return http.post(f"{stack.url}/v1/completions", json=body, headers=headers)

                one = asyncio.ensure_future(
                    post("beta", "one", {"model": "emu", "prompt": "x", "max_tokens": 60, "ignore_eos": True})
                )
                await asyncio.sleep(0.05)
                four = {"model": "emu", "prompt": "x", "n": REPLICA.max_batch, "max_tokens": 3, "ignore_eos": True}
                replies = await asyncio.gather(one, post("alpha", "four", four))
                assert [r.status_code for r in replies] == [200, 200]  # type: ignore[attr-defined]
                assert replies[1].json()["usage"]["completion_tokens"] == 3 * REPLICA.max_batch  # type: ignore[attr-defined]

        asyncio.run(run())
        iterations = list(replica_of(emulator).iterations)
        waiting = replica_of(emulator).waiting
    [dispatched] = recorder.of(Dispatched, "four")
    assert dispatched.queue_ms > 100  # it waited for the whole batch, until "one" ended (60 iterations)
    assert max(i.batch for i in iterations) == REPLICA.max_batch and waiting == 0  # never over the slots


def test_the_meter_charges_each_sequence_dt_over_b() -> None:
    cost = CostModel(8.0, 1.0, 0.0, 8)
    meter = LiveMeter(cost, 0.0, boundary_lag_ms=0.0)
    meter.start("pair", "a", 0, 0.0, sequences=2)
    meter.start("single", "b", 0, 0.0)
    meter.token(0.0)  # an iteration boundary: both are in the next iteration
    meter.advance(11.0)
    charges = {rid: meter.charged_ms(rid) for rid in ("pair", "single")}
    # B = 3 sequences: one iteration of 8 + 3 = 11 ms, 11/3 each; the pair pays two shares.
    assert charges == pytest.approx({"pair": 22.0 / 3, "single": 11.0 / 3})
    assert meter.sequences == 3 and meter.take_occupancy().sequences == pytest.approx(3.0)


async def test_the_dispatcher_holds_a_picked_request_until_n_slots_free_on_one_upstream() -> None:
    cost = CostModel(9, 0.55, 0.06, 2)
    upstreams = [Upstream("u0", "m", "http://x", 2, cost), Upstream("u1", "m", "http://y", 2, cost)]
    shares = {"a": TenantShare(), "b": TenantShare()}
    dispatcher = Dispatcher(
        lambda: make_policy(PolicySpec("fcfs", {}), cost, shares),
        upstreams,
        lambda: time.monotonic() * 1000.0,
        lambda t: None,
    )
    first = [await dispatcher.acquire(Request(i, "b", 1, float(i)), "m") for i in range(2)]  # one on each
    pair = asyncio.ensure_future(dispatcher.acquire(Request(2, "a", 1, 2.0, 4, sequences=2), "m"))
    single = asyncio.ensure_future(dispatcher.acquire(Request(3, "b", 1, 3.0), "m"))
    await asyncio.sleep(0.01)
    # Two slots are free, but not on one upstream: the pair is held and nobody passes it.
    assert not pair.done() and not single.done()
    assert dispatcher.running_by_tenant() == {"a": 2, "b": 2}
    dispatcher.release(first[0])
    lease = await asyncio.wait_for(pair, 1)
    assert lease.slots == 2 and lease.upstream.in_flight == 2
    assert (await asyncio.wait_for(single, 1)).upstream is not lease.upstream
    dispatcher.release(lease)
    assert lease.upstream.in_flight == 0 and dispatcher.running_by_tenant() == {"b": 2}


async def test_a_held_request_whose_caller_leaves_frees_the_pool() -> None:
    cost = CostModel(9, 0.55, 0.06, 2)
    upstream = Upstream("u0", "m", "http://x", 2, cost)
    dispatcher = Dispatcher(
        lambda: make_policy(PolicySpec("fcfs", {}), cost, {"a": TenantShare(), "b": TenantShare()}),
        [upstream],
        lambda: time.monotonic() * 1000.0,
        lambda t: None,
    )
    running = await dispatcher.acquire(Request(0, "b", 1, 0.0), "m")
    pair = asyncio.ensure_future(dispatcher.acquire(Request(1, "a", 1, 1.0, 4, sequences=2), "m"))
    single = asyncio.ensure_future(dispatcher.acquire(Request(2, "b", 1, 2.0), "m"))
    await asyncio.sleep(0.01)
    assert not single.done()  # behind the held pair
    pair.cancel()
    assert (await asyncio.wait_for(single, 1)).slots == 1
    assert upstream.in_flight == 2 and dispatcher.running_by_tenant() == {"b": 2}
    dispatcher.release(running)
