"""The live meter against the truth: an emulated replica (its own process, as deployed) applies seed 002's
charge rule to its real iterations and reports the GPU ms per cache_salt; the meter, which sees only when
requests are sent and when their tokens arrive, must bill each kind of request the same to within 3 %.

The mix is the hard case for a meter: prompt-heavy requests (1,500-5,000-token prompts, a few output
tokens) arriving during the iterations of decode-heavy ones, so most of them wait inside the replica for
an iteration boundary before their prefill; and short requests (50-300-token prompts, 1-3 output tokens),
some of which make an iteration before the one the meter puts them in and end at their first token
(``LiveMeter.first_token`` gives their prefill back then)."""

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
