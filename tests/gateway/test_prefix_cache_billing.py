"""Prefix-cache hits billed as the engine spent them: an emulated replica with automatic prefix caching (its
own process, as deployed) prefills only the uncached part of a prompt and reports it in its usage
(``prompt_tokens_details.cached_tokens``); it applies seed 002's charge rule to its real iterations and
reports the GPU ms per cache_salt. One tenant re-sends one long prompt (cached after its first), the other
sends prompts never seen. A meter that sizes each prefill by the whole prompt over-bills the first and
under-bills the second; the correction at settlement (``fairgate.core.prefix_cache``) takes most of the
difference off the first's bills and books it to the second in the policy."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import httpx
import pytest

from fairgate.core.cost import CostModel
from fairgate.gateway.dispatch import Upstream
from fairgate.gateway.upstream import CallState, UpstreamClient
from fairgate.harness.process import fairgate_process, free_port
from tests.conftest import timing_claims_hold_here

COST = CostModel(9.0, 0.55, 0.06, 24)
PROMPT_TOKENS = 3000
TENANTS = ("repeat", "fresh")


@dataclasses.dataclass
class Run:
    calls: dict[str, list[CallState]]
    truth: dict[str, float]  # the replica's charge rule, GPU ms per tenant
    busy_ms: float
    moves: list[dict[str, float]]  # the policy corrections

    def billed(self, tenant: str) -> float:
        return sum(c.gpu_ms for c in self.calls[tenant])

    def error(self, tenant: str) -> float:
        return abs(self.billed(tenant) / self.truth[tenant] - 1)


@pytest.mark.serial  # timing-sensitive: runs alone after the parallel part of the suite (scripts/test)
def test_a_cached_prompt_is_billed_its_uncached_prefill_and_the_time_goes_to_those_beside_it():
    port = free_port()
    args = ["emulate", "--port", str(port), "--model", "emu", "--max-model-len", "32768", "--prefix-caching"]
    with fairgate_process(args, port) as url:
        run = asyncio.run(_drive(url, "run", accounting=True))
        naive = asyncio.run(_drive(url, "naive", accounting=False))  # the meter alone, sized by whole prompts
    for name, r in (("cache accounted", run), ("whole prompts", naive)):
        billed, truth = {t: round(r.billed(t)) for t in TENANTS}, {t: round(v) for t, v in r.truth.items()}
        print(f"{name}: billed {billed} truth {truth}")
    # The replica's cache was hit: after its first, each repeat read the prompt cached; the fresh ones never.
    repeat = run.calls["repeat"]
    assert sum(c.cached_tokens >= 0.9 * PROMPT_TOKENS for c in repeat) >= len(repeat) - 2
    assert all(c.cached_tokens == 0 == c.cache_credit_ms for c in run.calls["fresh"])
    # The policy's counters: the fresh tenant is booked what was taken off the repeater's bills beside it.
    to_fresh = sum(m.get("fresh", 0.0) for m in run.moves)
    assert to_fresh == pytest.approx(sum(c.cache_credit_ms for c in repeat), rel=1e-9)
    # Each correction moved GPU time between tenants in the policy, none made or lost; billed and corrected,
    # the meter still splits exactly the time the replica was busy.
    credited = sum(c.cache_credit_ms for calls in run.calls.values() for c in calls)
    assert run.moves and all(sum(m.values()) == pytest.approx(0.0, abs=1e-9 * run.busy_ms) for m in run.moves)
    assert sum(run.billed(t) for t in TENANTS) + credited == pytest.approx(run.busy_ms, rel=1e-6)
    # The errors against the replica's truth depend on when tokens reach the meter: a slow machine stamps them
    # late. Measured on a loaded 2-core machine: whole prompts 33-45 % over (repeat); corrected 8-17 % over (the
    # requests beside a cached one often hit the cache too, and their weights were inflated as well).
    timing_claims_hold_here("billing errors against the replica's own charge rule")
    assert naive.error("repeat") > 0.15 and naive.error("fresh") > 0.05  # 16x the prefill weighed: far off
    assert run.billed("repeat") > 0.97 * run.truth["repeat"]  # never billed below what it used
    assert run.error("repeat") <= 0.25 and run.error("repeat") < naive.error("repeat") / 1.8
    assert abs((run.billed("fresh") + to_fresh) / run.truth["fresh"] - 1) < naive.error("fresh")
    assert run.busy_ms == pytest.approx(sum(run.truth.values()), rel=0.03)


async def _drive(url: str, salt: str, accounting: bool) -> Run:
    moves: list[dict[str, float]] = []
    upstream = Upstream("emu-0", "emu", f"{url}/v1", COST.max_batch, COST)
    client = UpstreamClient(upstream, lambda *args: None, correct=moves.append)
    if not accounting:
        client.kind = dataclasses.replace(client.kind, prefix_cache=False)
    slots = asyncio.Semaphore(COST.max_batch)  # as the dispatcher: at most max_batch in flight
    calls: dict[str, list[CallState]] = {t: [] for t in TENANTS}
    rng = random.Random(11)
    repeated = " ".join(f"r{i}" for i in range(PROMPT_TOKENS))

    async def one(tenant: str, index: int) -> None:
        prompt = repeated if tenant == "repeat" else " ".join(f"f{index}x{i}" for i in range(PROMPT_TOKENS))
        async with slots:
            call = CallState(f"{salt}-{tenant}-{index}", tenant, PROMPT_TOKENS)
            body = {"model": "emu", "prompt": prompt, "max_tokens": rng.randint(40, 120), "ignore_eos": True}
            async for _ in client.stream("/completions", body | {"cache_salt": f"{salt}-{tenant}"}, call, 0.0):
                pass
            calls[tenant].append(call)

    async def arrivals(tenant: str, count: int) -> None:
        tasks = []
        for index in range(count):
            tasks.append(asyncio.ensure_future(one(tenant, index)))
            await asyncio.sleep(rng.expovariate(1 / 0.12))
        await asyncio.gather(*tasks)

    await asyncio.gather(*(arrivals(t, 40) for t in TENANTS))
    stats = httpx.get(f"{url}/emulator/stats", timeout=10).json()["charge_rule_ms_by_cache_salt"]
    await client.close()
    truth = {t: stats[f"{salt}-{t}"] for t in TENANTS}
    return Run(calls, truth, client.meter.busy_ms, moves)
