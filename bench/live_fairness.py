"""Fairness live: four tenants with seed 002's output mix keep their queues full through the gateway,
against two emulated replicas, with the real ``openai`` client; GPU shares realised in the ledger.

Each tenant runs ``--clients`` concurrent clients; each request has a 400-token prompt and an output length
drawn from the tenant's lognormal (means 23.7 / 53 / 197 / 353.8 tokens, cv 0.5), sent as ``max_tokens``
with ``ignore_eos``. The replicas use seed 002's cost model (9 ms + 0.55 ms x B + 0.06 ms/token, 24 slots).
One run per policy; prints each tenant's share of the GPU time the ledger billed, and max/min.

Usage: .venv/bin/python bench/live_fairness.py [--seconds 60] [--policies gpu_fair,fcfs,vtc] [--clients 16]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fairgate.emulator.api import EmulatorSettings, create_app  # noqa: E402
from fairgate.gateway.app import create_gateway  # noqa: E402
from fairgate.gateway.auth import hash_api_key  # noqa: E402
from fairgate.gateway.config import load_gateway_config  # noqa: E402
from fairgate.ledger import connect  # noqa: E402
from tests.support.servers import serve  # noqa: E402

MIX = {"classify": 23.7, "chat": 53.0, "summarise": 197.0, "agent": 353.8}
PROMPT = "w " * 397  # + 3 tokens of chat overhead = 400


def config_text(folder: Path, upstreams: list[str], policy: str, keys: dict[str, str]) -> str:
    ups = "".join(f'[[upstream]]\nname = "emu-{i}"\nurl = "{u}/v1"\nmodel = "emu"\nmax_batch = 24\n'
                  f"iter_base_ms = 9.0\niter_slope_ms = 0.55\nprefill_ms_per_token = 0.06\nmax_model_len = 32768\n"
                  for i, u in enumerate(upstreams))
    tenants = "".join(f'[quotas.tenants.{t}]\ntier = "t"\n' for t in MIX)
    key_tables = "".join(f'[[key]]\ntenant = "{t}"\nhash = "{hash_api_key(k)}"\n' for t, k in keys.items())
    return (f'[gateway]\npolicy = "{policy}"\nledger = "sqlite:///{folder}/ledger.db"\n'
            f'journal = "{folder}/journal.jsonl"\n\n{ups}\n[quotas.tiers.t]\non_ledger_unavailable = "reject"\n'
            f"[quotas.defaults]\nmax_queued = 1000\nmax_concurrent = 1000\n{tenants}\n{key_tables}")


async def load(url: str, keys: dict[str, str], seconds: float, clients: int, seed: int) -> dict[str, int]:
    done = {t: 0 for t in MIX}

    async def worker(tenant: str, index: int) -> None:
        rng = random.Random(f"{seed}-{tenant}-{index}")
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=keys[tenant], max_retries=0, timeout=600)
        sigma2 = math.log1p(0.25)
        mu = math.log(MIX[tenant]) - sigma2 / 2
        while True:
            tokens = max(1, round(rng.lognormvariate(mu, math.sqrt(sigma2))))
            await client.chat.completions.create(model="emu", messages=[{"role": "user", "content": PROMPT}],
                                                 max_tokens=tokens, extra_body={"ignore_eos": True})
            done[tenant] += 1
        await client.close()

    # Interleaved, so no tenant's requests all arrive first.
    tasks = [asyncio.create_task(worker(t, i)) for i in range(clients) for t in MIX]
    await asyncio.sleep(seconds)
    # At the deadline every client hangs up: the gateway cancels the requests in flight and bills what they
    # consumed, so the shares are those of the window, not of a drain where only long requests remain.
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(1.0)  # let the gateway settle the cancelled ones
    return done


async def shares(config_path: Path) -> dict[str, float]:
    config = load_gateway_config(config_path)
    ledger = await connect(config.ledger_url, config.quotas)
    gpu = {t: 0.0 for t in MIX}
    for r in await ledger.reservations():
        gpu[r.tenant] += r.billed.gpu_ms
    await ledger.close()
    total = sum(gpu.values())
    return {t: g / total for t, g in gpu.items()}


def run(policy: str, seconds: float, clients: int) -> tuple[dict[str, float], dict[str, int]]:
    folder = Path(tempfile.mkdtemp(prefix="fairgate-live-"))
    keys = {t: f"fg-bench-{t}-{'k' * 20}" for t in MIX}
    settings = EmulatorSettings(model="emu")
    with serve(create_app(settings)) as u0, serve(create_app(settings)) as u1:
        path = folder / "fairgate.toml"
        path.write_text(config_text(folder, [u0, u1], policy, keys))
        with serve(create_gateway(load_gateway_config(path))) as gateway:
            done = asyncio.run(load(gateway, keys, seconds, clients, 1))
    return asyncio.run(shares(path)), done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--policies", default="gpu_fair,fcfs,vtc")
    parser.add_argument("--clients", type=int, default=48,
                        help="concurrent clients per tenant (48: each alone could fill both replicas)")
    args = parser.parse_args()
    print(f"{args.seconds:g} s per policy, {args.clients} clients per tenant, 2 emulated replicas x 24 slots")
    for policy in args.policies.split(","):
        share, done = run(policy, args.seconds, args.clients)
        ratio = max(share.values()) / min(share.values())
        cells = "  ".join(f"{t} {share[t] * 100:5.1f}% ({done[t]} req)" for t in MIX)
        print(f"  {policy:10s} {cells}   max/min {ratio:.3f}")


if __name__ == "__main__":
    main()
