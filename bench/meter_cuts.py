"""Cut requests billed against what the replica spent, two gateway processes on one replica, in one run.

Two upstream clients (each as one gateway process's) share an emulated replica (its own process) and each
other's occupancy every 100 ms, as ``fairgate.gateway.sharing`` does through the ledger. Client A keeps
decoding streams and long prompts running; client B, with nothing else in flight, sends long prompts one at a
time and cuts each ``--cut-ms`` after its send (an honest client's quick cancel, or a deadline). No token of
B's own can end the step a cut request may be in, so the meter keeps it ``LiveMeter.leave_after_ms``: the step
times the chance the replica took it in. Prints, per side, what the meters billed over what the replica's
charge rule gave the same requests (``/emulator/stats``), per seed and pooled.

Usage: .venv/bin/python bench/meter_cuts.py [--seeds 1,2,3] [--cuts 40] [--cut-ms 1,5]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fairgate.core.cost import CostModel
from fairgate.gateway.dispatch import Upstream
from fairgate.gateway.upstream import CallState, UpstreamClient
from fairgate.harness.process import fairgate_process, free_port

COST = CostModel(9.0, 0.55, 0.06, 24)
Totals = dict[str, list[float]]  # side -> [billed ms, charge rule ms]


def _body(call: CallState, output_tokens: int) -> dict[str, object]:
    return {
        "model": "emu",
        "prompt": "w " * call.prompt_tokens,
        "max_tokens": output_tokens,
        "ignore_eos": True,
        "cache_salt": call.request_id,
    }


async def _share(a: UpstreamClient, b: UpstreamClient) -> None:
    while True:
        await asyncio.sleep(0.1)
        taken_a, taken_b = a.take_occupancy(), b.take_occupancy()
        a.set_remote(taken_b)
        b.set_remote(taken_a)


async def _load(client: UpstreamClient, rng: random.Random, calls: list[tuple[str, CallState]]) -> None:
    """Side A: 8 decoding streams, and 25 long prompts of a few tokens arriving over ~6 s."""

    async def one(name: str, prompt_tokens: int, output_tokens: int) -> None:
        call = CallState(name, "A", prompt_tokens)
        async for _ in client.stream("/completions", _body(call, output_tokens), call, 0.0):
            pass
        calls.append(("A", call))

    tasks = [asyncio.ensure_future(one(f"dec-{i}", rng.randint(200, 400), rng.randint(600, 900))) for i in range(8)]
    for index in range(25):
        await asyncio.sleep(rng.uniform(0.1, 0.4))
        tasks.append(asyncio.ensure_future(one(f"pre-{index}", rng.randint(1500, 4000), rng.randint(3, 10))))
    await asyncio.gather(*tasks)


async def _cut(client: UpstreamClient, name: str, cut_s: float, rng: random.Random) -> CallState:
    """Side B: one long prompt, cut ``cut_s`` after its send unless its first token came first."""
    call = CallState(name, "B", rng.randint(1500, 4000))
    stream = client.stream("/completions", _body(call, 50), call, 0.0)
    try:
        await asyncio.wait_for(stream.__anext__(), cut_s)
    except TimeoutError:
        pass
    await stream.aclose()
    if call.leaving is not None:
        await call.leaving
    return call


async def _drive(url: str, seed: int, cuts: int, cut_ms: tuple[float, float]) -> Totals:
    upstream = Upstream("emu-0", "emu", f"{url}/v1", 24, COST)
    a, b = UpstreamClient(upstream, lambda *args: None), UpstreamClient(upstream, lambda *args: None)
    rng, calls = random.Random(seed), list[tuple[str, CallState]]()
    sharer = asyncio.ensure_future(_share(a, b))
    load = asyncio.ensure_future(_load(a, rng, calls))
    await asyncio.sleep(0.5)
    for index in range(cuts):
        calls.append(("B", await _cut(b, f"cut-{index}", rng.uniform(*cut_ms) / 1000.0, rng)))
        await asyncio.sleep(rng.uniform(0.05, 0.15))
    await load
    sharer.cancel()
    async with httpx.AsyncClient(timeout=10) as http:
        stats = (await http.get(f"{url}/emulator/stats")).json()["charge_rule_ms_by_cache_salt"]
    await a.close()
    await b.close()
    return {
        side: [
            sum(c.gpu_ms for s, c in calls if s == side),
            sum(stats.get(c.request_id, 0.0) for s, c in calls if s == side),
        ]
        for side in "AB"
    }


def _ratio(totals: list[float]) -> str:
    return f"{totals[0]:8.1f} / {totals[1]:8.1f} ms = {totals[0] / totals[1]:.3f}" if totals[1] else "no charge rule"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated seeds (default 1,2,3)")
    parser.add_argument("--cuts", type=int, default=40, help="requests side B cuts per seed (default 40)")
    parser.add_argument("--cut-ms", default="1,5", help="the cut's delay after the send, LO,HI ms (default 1,5)")
    args = parser.parse_args()
    lo, hi = (float(x) for x in args.cut_ms.split(","))
    pooled: Totals = {"A": [0.0, 0.0], "B": [0.0, 0.0]}
    for seed in (int(s) for s in args.seeds.split(",")):
        port = free_port()
        command = ["emulate", "--port", str(port), "--model", "emu", "--max-model-len", "32768"]
        with fairgate_process(command, port) as url:
            totals = asyncio.run(_drive(url, seed, args.cuts, (lo, hi)))
        print(f"seed {seed}: B (cut {lo:g}-{hi:g} ms) {_ratio(totals['B'])}   A {_ratio(totals['A'])}")
        for side in "AB":
            pooled[side] = [p + t for p, t in zip(pooled[side], totals[side], strict=True)]
    print(f"pooled:  B billed / charge rule {_ratio(pooled['B'])}   A {_ratio(pooled['A'])}")


if __name__ == "__main__":
    main()
