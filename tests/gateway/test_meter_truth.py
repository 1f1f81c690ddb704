"""The live meter against the truth: an emulated replica (its own process, as deployed) applies seed 002's
charge rule to its real iterations and reports the GPU ms per cache_salt; the meter, which sees only when
requests are sent and when their tokens arrive, must bill each kind of request the same to within 3 %.

The mix is the hard case for a meter: prompt-heavy requests (1,500-5,000-token prompts, a few output
tokens) arriving during the iterations of decode-heavy ones, so most of them wait inside the replica for
an iteration boundary before their prefill; and short requests (50-300-token prompts, 1-3 output tokens),
some of which make an iteration before the one the meter puts them in and end at their first token
(``LiveMeter.first_token`` gives their prefill back then).

Requests cut before their first token are the other hard case: the replica spends the step a request is
prefilled in whether or not its client stays, and a cut request the meter still had pending, or let go at the
cut, was billed little or nothing of it (``LiveMeter.cut``)."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from fairgate.core.cost import CostModel
from fairgate.gateway.dispatch import Upstream
from fairgate.gateway.upstream import CallState, UpstreamClient
from fairgate.harness.process import fairgate_process, free_port

COST = CostModel(9.0, 0.55, 0.06, 24)
KINDS = ("decode-heavy", "prompt-heavy", "short")


@pytest.mark.serial  # timing-sensitive: runs alone after the parallel part of the suite (scripts/test)
def test_the_meter_bills_what_the_replica_spent():
    port = free_port()
    with fairgate_process(["emulate", "--port", str(port), "--model", "emu", "--max-model-len", "32768"], port) as url:
        billed, truth, busy = asyncio.run(_drive(url))
    for kind in KINDS:
        assert billed[kind] == pytest.approx(truth[kind], rel=0.03), (kind, billed, truth)
    # The meter splits exactly the time the replica was busy (to the jitter of token delivery).
    assert busy == pytest.approx(sum(truth.values()), rel=0.02)


async def _drive(url: str) -> tuple[dict[str, float], dict[str, float], float]:
    client = UpstreamClient(Upstream("emu-0", "emu", f"{url}/v1", 24, COST), lambda *args: None)
    slots = asyncio.Semaphore(COST.max_batch)  # as the dispatcher: at most max_batch in flight
    calls: list[tuple[str, CallState]] = []
    rng = random.Random(7)

    async def one(kind: str, index: int, prompt_tokens: int, output_tokens: int) -> None:
        async with slots:
            call = CallState(f"{kind}-{index}", kind, prompt_tokens)
            body = {
                "model": "emu",
                "prompt": "w " * prompt_tokens,
                "max_tokens": output_tokens,
                "ignore_eos": True,
                "cache_salt": call.request_id,
            }
            async for _ in client.stream("/completions", body, call, 0.0):
                pass
            calls.append((kind, call))

    async def arrivals(kind: str, count: int, prompt: tuple[int, int], output: tuple[int, int], gap_s: float) -> None:
        tasks = []
        for index in range(count):
            tasks.append(asyncio.ensure_future(one(kind, index, rng.randint(*prompt), rng.randint(*output))))
            await asyncio.sleep(rng.expovariate(1 / gap_s))
        await asyncio.gather(*tasks)

    await asyncio.gather(
        arrivals("decode-heavy", 30, (200, 800), (100, 400), 0.15),
        arrivals("prompt-heavy", 60, (1500, 5000), (5, 30), 0.08),
        arrivals("short", 120, (50, 300), (1, 3), 0.05),
    )
    stats = httpx.get(f"{url}/emulator/stats", timeout=10).json()["charge_rule_ms_by_cache_salt"]
    await client.close()
    billed = {kind: sum(c.gpu_ms for k, c in calls if k == kind) for kind in KINDS}
    truth = {kind: sum(stats[c.request_id] for k, c in calls if k == kind) for kind in billed}
    return billed, truth, client.meter.busy_ms


@pytest.mark.serial  # timing-sensitive: runs alone after the parallel part of the suite (scripts/test)
def test_requests_cut_before_their_first_token_are_billed_what_the_replica_spent():
    """Long prompts cut 5-250 ms after they were sent, some sent the instant a decoding stream's token arrived
    (a step boundary: an attacker's timing), beside decoding requests of another tenant; each side is billed
    the replica's charge rule for its requests to within 5 %."""
    port = free_port()
    with fairgate_process(["emulate", "--port", str(port), "--model", "emu", "--max-model-len", "32768"], port) as url:
        billed, truth, cut_before_first_token = asyncio.run(_drive_cuts(url))
    assert cut_before_first_token >= 40, cut_before_first_token  # the case under test, not requests that ran
    for side in ("cutter", "decoder"):
        assert billed[side] == pytest.approx(truth[side], rel=0.05), (side, billed, truth)


async def _drive_cuts(url: str) -> tuple[dict[str, float], dict[str, float], int]:
    client = UpstreamClient(Upstream("emu-0", "emu", f"{url}/v1", 24, COST), lambda *args: None)
    calls: list[tuple[str, CallState]] = []
    boundary = asyncio.Event()  # set at each token of a decoding stream: a step just ended
    rng, cut_early = random.Random(11), 0

    def body(call: CallState, output_tokens: int) -> dict[str, object]:
        prompt = "w " * call.prompt_tokens
        return {
            "model": "emu",
            "prompt": prompt,
            "max_tokens": output_tokens,
            "ignore_eos": True,
            "cache_salt": call.request_id,
        }

    async def decoder(index: int) -> None:
        call = CallState(f"decoder-{index}", "decoder", rng.randint(200, 400))
        async for _ in client.stream("/completions", body(call, rng.randint(400, 700)), call, 0.0):
            boundary.set()
            boundary.clear()
        calls.append(("decoder", call))

    async def cutter(index: int, timed: bool) -> None:
        nonlocal cut_early
        if timed:
            await boundary.wait()
        call = CallState(f"cutter-{index}", "cutter", rng.randint(1500, 4000))
        stream = client.stream("/completions", body(call, 50), call, 0.0)
        try:
            await asyncio.wait_for(stream.__anext__(), rng.uniform(0.005, 0.25))
        except TimeoutError:
            cut_early += 1
        await stream.aclose()  # type: ignore[attr-defined]
        if call.leaving is not None:
            await call.leaving
        calls.append(("cutter", call))

    decoders = [asyncio.ensure_future(decoder(index)) for index in range(6)]
    await asyncio.sleep(0.3)
    for index in range(70):
        await cutter(index, timed=index % 2 == 0)
        await asyncio.sleep(rng.uniform(0.0, 0.1))
    await asyncio.gather(*decoders)
    stats = httpx.get(f"{url}/emulator/stats", timeout=10).json()["charge_rule_ms_by_cache_salt"]
    await client.close()
    billed = {side: sum(c.gpu_ms for k, c in calls if k == side) for side in ("cutter", "decoder")}
    truth = {side: sum(stats.get(c.request_id, 0.0) for k, c in calls if k == side) for side in billed}
    return billed, truth, cut_early
