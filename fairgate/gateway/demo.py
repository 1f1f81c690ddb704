"""``fairgate serve`` without a configuration: a demo stack in one process.

An emulated replica (seed 002's cost model) on a free loopback port, a gateway config in a new folder with
an SQLite ledger and four tenants (classify, chat, summarise, agent), a key per tenant and an admin key,
printed once; and, unless turned off, demo traffic: each tenant keeps a few requests in flight with seed
002's output-length mix, so the GPU-time shares, the metrics and the dashboard have something to show.

The traffic runs in labelled phases (``DEMO_PHASES``, announced as each begins): *within capacity*, fewer
requests in flight than the replica has slots, so nothing queues and TTFT is the prefill (the objective
holds); then *overload*, twice as many as its slots, where the fair queues decide who runs and TTFT grows
with the queue, on purpose. Within capacity every request runs at once, so a tenant's GPU time is what it
asks for (short requests pay their prefill more often); in overload the fair policy splits it evenly.
``PhaseShares`` reads each phase's split from the gateway's live meter, to print at the end.
"""

from __future__ import annotations

import asyncio
import math
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fairgate.gateway.auth import new_api_key
from fairgate.gateway.config import GatewaySection, UpstreamConfig
from fairgate.gateway.config_writer import GatewayFile, admin_keys, key_entries
from fairgate.ledger.base import tenant_tag
from fairgate.ledger.config import LimitsConfig, QuotaFile, TenantConfig, TierConfig

DEMO_TENANTS = ("classify", "chat", "summarise", "agent")
DEMO_MODEL = "fairgate-emulated"
# Seed 002's mean output lengths (tokens) per tenant; lognormal with cv 0.5; 400-token prompts.
DEMO_OUTPUT_MEAN_TOKENS = {"classify": 23.7, "chat": 53.0, "summarise": 197.0, "agent": 353.8}
DEMO_PROMPT = "w " * 397  # + 3 tokens of chat-message overhead = 400 tokens
DEMO_SLOTS = 24  # the demo replica's max_batch
# (label, clients per tenant, seconds): 4 x 5 = 20 in flight on 24 slots, then 4 x 12 = 48.
DEMO_PHASES = (("within capacity", 5, 30.0), ("overload", 12, 30.0))


def phase_line(label: str, clients_per_tenant: int, seconds: float) -> str:
    """How a phase is announced."""
    in_flight = clients_per_tenant * len(DEMO_TENANTS)
    effect = (
        "nothing queues, TTFT is the prefill"
        if in_flight <= DEMO_SLOTS
        else "requests queue and the fair policy picks who runs; TTFT grows past its objective, on purpose"
    )
    return f"demo traffic: {label} for {seconds:g} s - {in_flight} requests in flight on {DEMO_SLOTS} slots: {effect}"


@dataclass
class PhaseShares:
    """Each demo phase's GPU seconds per tenant, read from the gateway's live meter
    (``fairgate_gpu_seconds_total``, charged as the time is spent, so a phase's figures are its own and not
    those of the requests that happened to settle in it). ``mark`` at each phase's start and at the end."""

    url: str
    admin_key: str
    tenants: tuple[str, ...] = DEMO_TENANTS  # the meter labels tenants by hash: these are named back
    marks: list[tuple[str | None, float, dict[str, float]]] = field(default_factory=list)

    async def charged(self) -> dict[str, float]:
        """GPU seconds charged per tenant since the gateway started."""
        async with httpx.AsyncClient(base_url=self.url, timeout=10) as http:
            reply = await http.get("/metrics", headers={"Authorization": f"Bearer {self.admin_key}"})
        reply.raise_for_status()
        names = {tenant_tag(tenant): tenant for tenant in self.tenants}
        totals: dict[str, float] = {}
        for family in text_string_to_metric_families(reply.text):
            for sample in family.samples:
                if sample.name == "fairgate_gpu_seconds_total":
                    tenant = names.get(sample.labels["tenant"], sample.labels["tenant"])
                    totals[tenant] = totals.get(tenant, 0.0) + sample.value
        return totals

    async def mark(self, label: str | None) -> None:
        """A phase ``label`` starts now (None: the demo ends). A meter that cannot be read skips the mark: the
        phase is then counted with the one before it."""
        try:
            totals = await self.charged()
        except (httpx.HTTPError, ValueError):
            return
        self.marks.append((label, time.monotonic(), totals))

    def phases(self) -> list[tuple[str, float, dict[str, float]]]:
        """(label, seconds, tenant -> GPU seconds) of each phase marked, in order."""
        out = []
        for (label, start, before), (_, end, after) in zip(self.marks, self.marks[1:], strict=False):
            if label is not None:
                spent = {tenant: after.get(tenant, 0.0) - before.get(tenant, 0.0) for tenant in after}
                out.append((label, end - start, spent))
        return out


async def demo_traffic(
    url: str,
    keys: dict[str, str],
    phases: tuple[tuple[str, int, float], ...] = DEMO_PHASES,
    seed: int = 1,
    announce: Callable[[str], None] = lambda line: None,
    meter: PhaseShares | None = None,
) -> None:
    """Run ``phases`` (label, clients per tenant, seconds) over and over against the gateway at ``url`` until
    cancelled, each announced with ``phase_line`` (and marked on ``meter``). Errors (a 429, a restart) pause
    that client for a second; nothing is retried blindly."""
    active = [phases[0][1]]  # clients per tenant now: a client of a higher index waits for its phase

    async def client(http: httpx.AsyncClient, tenant: str, index: int) -> None:
        rng = random.Random(f"{seed}-{tenant}-{index}")
        sigma2 = math.log1p(0.25)
        mu = math.log(DEMO_OUTPUT_MEAN_TOKENS[tenant]) - sigma2 / 2
        headers = {"Authorization": f"Bearer {keys[tenant]}"}
        while True:
            if index >= active[0]:
                await asyncio.sleep(0.2)
                continue
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

    async def schedule() -> None:
        while True:
            for label, clients, seconds in phases:
                active[0] = clients
                announce(phase_line(label, clients, seconds))
                if meter is not None:
                    await meter.mark(label)
                await asyncio.sleep(seconds)

    most = max(clients for _, clients, _ in phases)
    limits = httpx.Limits(max_connections=most * len(keys) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        await asyncio.gather(
            schedule(),
            *(client(http, tenant, i) for tenant in keys if tenant in DEMO_OUTPUT_MEAN_TOKENS for i in range(most)),
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
                max_batch=DEMO_SLOTS,
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
