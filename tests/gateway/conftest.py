"""A real gateway in front of real emulated replicas, over loopback HTTP, with a real SQLite ledger."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from fairgate.emulator.api import create_app
from fairgate.gateway.app import create_gateway
from fairgate.gateway.config import GatewayConfig, GatewaySection, load_gateway_config
from fairgate.harness.config import TenantSpec, gateway_file, quota_file
from fairgate.harness.replica import ReplicaModel
from fairgate.harness.threads import serve_in_thread
from fairgate.ledger import Ledger, Reservation, connect
from fairgate.ledger.config import LimitsConfig, PricingConfig, TierConfig

T = TypeVar("T")

# dt = 4 + 0.25 B + 0.01 per prompt token (ms), 4 slots, a 2,048-token context, outputs of 20 tokens on average
REPLICA = ReplicaModel(4.0, 0.25, 0.01, 4, 2048, 20.0)
EMULATOR = REPLICA.settings("emu")


def slower(factor: float) -> ReplicaModel:
    """``REPLICA`` with decode iterations ``factor`` times as long: an engine the gateway's cost model
    (``REPLICA``'s) no longer describes."""
    return replace(REPLICA, iter_base_ms=factor * REPLICA.iter_base_ms, iter_slope_ms=factor * REPLICA.iter_slope_ms)


TENANTS = ("alpha", "beta", "gamma")
BODY = {"model": "emu", "prompt": "x", "max_tokens": 2, "ignore_eos": True}


def ledger_call(config: GatewayConfig, work: Callable[[Ledger], Awaitable[T]]) -> T:
    """What ``work`` returns on a connection of its own to ``config``'s ledger (closed afterwards)."""

    async def run() -> T:
        async with await connect(config.ledger_url, config.quotas) as ledger:
            return await work(ledger)

    return asyncio.run(run())


def post(
    url: str,
    key: str,
    body: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
    timeout: float = 30.0,
) -> httpx.Response:
    """``body`` (default ``BODY``) POSTed to the gateway's /v1/completions with ``key`` and ``headers``."""
    return httpx.post(
        f"{url}/v1/completions",
        json=body or BODY,
        timeout=timeout,
        headers={"Authorization": f"Bearer {key}", **(headers or {})},
    )


def post_at_once(
    requests: Sequence[tuple[str, str, Mapping[str, Any], Mapping[str, str] | None]], timeout: float = 60.0
) -> list[httpx.Response]:
    """Each ``(gateway url, key, body, headers)`` POSTed to /v1/completions, all at once; the replies in order."""

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=timeout) as http:
            calls = [
                http.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}", **(h or {})})
                for url, key, body, h in requests
            ]
            return list(await asyncio.gather(*calls))

    return asyncio.run(run())


class Clock:
    """A clock (seconds) the test sets by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Recorder:
    """A gateway observer that keeps every event it sees."""

    def __init__(self) -> None:
        self.events: list[object] = []

    def observe(self, event: object) -> None:
        self.events.append(event)

    def of(self, kind: type, request_id: str | None = None) -> list:  # type: ignore[type-arg]
        return [
            e
            for e in self.events
            if isinstance(e, kind) and (request_id is None or getattr(e, "request_id", None) == request_id)
        ]


@dataclass
class Stack:
    url: str  # the gateway's base URL
    keys: dict[str, str]  # tenant -> API key
    config_path: Path
    config: GatewayConfig  # as the gateway loaded it

    @property
    def ledger_url(self) -> str:
        return self.config.ledger_url

    def ledger_call(self, work: Callable[[Ledger], Awaitable[T]]) -> T:
        """What ``work`` returns on a connection of its own to the gateway's ledger (closed afterwards)."""
        return ledger_call(self.config, work)

    def reservations(self) -> list[Reservation]:
        return self.ledger_call(lambda ledger: ledger.reservations())


def write_config(
    tmp: Path,
    upstream_urls: list[str],
    policy: str = "gpu_fair",
    defaults: LimitsConfig | None = None,
    limits: Mapping[str, LimitsConfig] | None = None,
    admin_key: str | None = None,
    delegates: Sequence[str] = (),
    secret_env: str | None = None,
    sweep_s: float | None = None,
    name: str = "fairgate.toml",
    ledger: str | None = None,
    models: Sequence[str] | None = None,
    upstream_table: Mapping[str, Any] | None = None,
    gateway_table: Mapping[str, Any] | None = None,
    pricing: PricingConfig | None = None,
    tiers: Mapping[str, TierConfig] | None = None,
) -> tuple[Path, dict[str, str]]:
    """``tmp/<name>``: the gateway in front of ``upstream_urls`` (``REPLICA`` each) with an SQLite ledger and
    journal in ``tmp`` (or the ledger at URL ``ledger``), ``TENANTS`` (tier ``free``, ``limits`` by tenant)
    over ``defaults`` (``max_queued`` 64 unless given), and the optional admin key, delegation and sweep;
    ``models``: the model each upstream serves (default ``emu``); ``upstream_table``: more keys of every
    ``[[upstream]]`` table (``kind``, ``api_key_env``, ...); ``gateway_table``: more keys of ``[gateway]``;
    ``pricing``: ``[quotas.pricing]``; ``tiers``: a tier of its own (named after it) for a tenant.
    Returns its path and the keys."""
    keys = {tenant: f"fg-test-{tenant}-{'x' * 24}" for tenant in TENANTS}
    defaults = defaults or LimitsConfig()
    if defaults.max_queued is None:
        defaults = defaults.model_copy(update={"max_queued": 64})
    section = GatewaySection(
        policy=policy,
        ledger=ledger or f"sqlite:///{tmp}/ledger.db",
        journal=f"{tmp}/journal.jsonl",
        default_max_tokens=64,
        max_body_bytes=65536,
        **({"sweep_s": sweep_s} if sweep_s is not None else {}),
        **(gateway_table or {}),
    )
    tiers = tiers or {}
    tenants = [
        TenantSpec(t, tier=t if t in tiers else "free", limits=(limits or {}).get(t, LimitsConfig())) for t in TENANTS
    ]
    served = models or ["emu"] * len(upstream_urls)
    upstreams = [
        REPLICA.upstream(f"emu-{i}", url, served[i], **(upstream_table or {})) for i, url in enumerate(upstream_urls)
    ]
    quotas = quota_file(tenants, {"free": TierConfig(), **tiers}, defaults, pricing)
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / name
    gateway_file(section, upstreams, quotas, keys, admin_key, delegates, secret_env).write(path)
    return path, keys


@contextmanager
def serve_stack(tmp: Path, upstream: Any = None, observers: Sequence[Any] = (), **config: Any) -> Iterator[Stack]:
    """A gateway written by ``write_config(tmp, ..., **config)`` in front of ``upstream`` (an ASGI app; default
    the ``EMULATOR`` replica), both served on loopback until the block ends; ``observers`` see its events."""
    with serve_in_thread(upstream or create_app(EMULATOR)) as emulator:
        path, keys = write_config(tmp, [emulator], **config)
        gateway_config = load_gateway_config(path)
        with serve_in_thread(create_gateway(gateway_config, observers=list(observers))) as gateway:
            yield Stack(gateway, keys, path, gateway_config)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    with serve_stack(tmp_path) as served:
        yield served
