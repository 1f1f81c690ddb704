"""``fairgate serve`` without a configuration: a demo stack in one process.

An emulated replica (seed 002's cost model) on a free loopback port, a gateway config in a new folder with
an SQLite ledger and four tenants (classify, chat, summarise, agent), a key per tenant and an admin key,
printed once; and, unless turned off, demo traffic: each tenant keeps a few requests in flight with seed
002's output-length mix, so the GPU-time shares, the metrics and the dashboard have something to show.
"""

from __future__ import annotations

import asyncio
import math
import random
import tempfile
from pathlib import Path

import httpx

from fairgate.gateway.auth import new_api_key
from fairgate.gateway.config import GatewaySection, UpstreamConfig
from fairgate.gateway.config_writer import GatewayFile, admin_keys, key_entries
from fairgate.ledger.config import LimitsConfig, QuotaFile, TenantConfig, TierConfig

DEMO_TENANTS = ("classify", "chat", "summarise", "agent")
DEMO_MODEL = "fairgate-emulated"
# Seed 002's mean output lengths (tokens) per tenant; lognormal with cv 0.5; 400-token prompts.
DEMO_OUTPUT_MEAN_TOKENS = {"classify": 23.7, "chat": 53.0, "summarise": 197.0, "agent": 353.8}
DEMO_PROMPT = "w " * 397  # + 3 tokens of chat-message overhead = 400 tokens


async def demo_traffic(url: str, keys: dict[str, str], clients_per_tenant: int = 12, seed: int = 1) -> None:
    """Keep ``clients_per_tenant`` requests per demo tenant in flight against the gateway at ``url`` until
    cancelled. Errors (a 429, a restart) pause that client for a second; nothing is retried blindly."""

    async def client(http: httpx.AsyncClient, tenant: str, index: int) -> None:
        rng = random.Random(f"{seed}-{tenant}-{index}")
        sigma2 = math.log1p(0.25)
        mu = math.log(DEMO_OUTPUT_MEAN_TOKENS[tenant]) - sigma2 / 2
        headers = {"Authorization": f"Bearer {keys[tenant]}"}
        while True:
            tokens = max(1, round(rng.lognormvariate(mu, math.sqrt(sigma2))))
            body = {
                "model": DEMO_MODEL,
                "messages": [{"role": "user", "content": DEMO_PROMPT}],
                "max_tokens": tokens,
                "ignore_eos": True,
            }
            try:
                reply = await http.post("/v1/chat/completions", json=body, headers=headers)
                if reply.status_code != 200:
                    await asyncio.sleep(1.0)
            except httpx.HTTPError:
                await asyncio.sleep(1.0)

    limits = httpx.Limits(max_connections=clients_per_tenant * len(keys) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        await asyncio.gather(
            *(
                client(http, tenant, i)
                for tenant in keys
                if tenant in DEMO_OUTPUT_MEAN_TOKENS
                for i in range(clients_per_tenant)
            )
        )


def write_demo_config(folder: Path, upstream_url: str) -> tuple[Path, dict[str, str]]:
    """Write ``folder/fairgate.toml`` for the demo; returns its path and name -> API key (the four tenants
    and ``admin``, whose key opens the admin endpoints and the dashboard's all-tenant view)."""
    keys = {tenant: new_api_key() for tenant in DEMO_TENANTS}
    admin_key = new_api_key()
    demo = GatewayFile(
        GatewaySection(
            policy="gpu_fair",
            ledger="sqlite:///ledger.db",
            journal="journal.jsonl",
            access_log="access.jsonl",  # the demo's own traffic would flood the terminal
            default_max_tokens=256,
        ),
        (
            UpstreamConfig(
                name="emulated-0",
                url=f"{upstream_url}/v1",
                model=DEMO_MODEL,
                max_batch=24,
                iter_base_ms=9.0,
                iter_slope_ms=0.55,
                prefill_ms_per_token=0.06,
                max_model_len=32768,
                kind="vllm",  # the emulator speaks vLLM's dialect (cache_salt, ignore_eos)
            ),
        ),
        QuotaFile(
            tiers={"demo": TierConfig()},
            defaults=LimitsConfig(requests_per_minute=6000, requests_burst=200, max_concurrent=64, max_queued=256),
            tenants={t: TenantConfig(tier="demo") for t in DEMO_TENANTS},
        ),
        key_entries(keys, name="demo"),
        admin_keys(admin_key),
        comment="fairgate demo configuration (written by `fairgate serve` without --config).",
    )
    path = folder / "fairgate.toml"
    demo.write(path)
    return path, {**keys, "admin": admin_key}


def demo_folder() -> Path:
    return Path(tempfile.mkdtemp(prefix="fairgate-demo-"))
