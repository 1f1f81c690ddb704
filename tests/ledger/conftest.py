"""Ledger backends for the conformance suite: a real SQLite file, a real PostgreSQL and a real Redis
(``backend_url`` and the servers: ``tests/conftest.py``). Each test gets a fresh schema / key prefix,
dropped after. These tests are never skipped: a backend that cannot be reached fails them.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from fairgate.ledger import Ledger, Quotas, connect, quotas_from_dict
from fairgate.ledger.redis import RedisLedger

# "pgbouncer": PostgreSQL behind PgBouncer in transaction mode (each transaction on any server connection);
# "redis_cluster": a Redis Cluster of three masters (each tenant's keys on the node of its hash slot);
# "redis_eval": Redis running the scripts as EVAL scripts, as on a server without functions (``lua.py``).
BACKENDS = ("sqlite", "postgres", "pgbouncer", "redis", "redis_cluster", "redis_eval")


# The limits most ledger tests start from: small enough that a handful of requests reaches each one.
LIMITS = {
    "requests_per_minute": 60,
    "requests_burst": 5,
    "input_tokens_per_minute": 6000,
    "input_tokens_burst": 3000,
    "output_tokens_per_minute": 6000,
    "output_tokens_burst": 2000,
    "max_concurrent": 3,
    "gpu_seconds": 10,
    "gpu_window_s": 3600,
    "reservation_ttl_s": 60,
}


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


LedgerFactory = Callable[..., "asyncio.Future[Ledger]"]


@pytest.fixture
async def open_ledger(backend: str, backend_url) -> AsyncIterator[Callable[..., object]]:  # type: ignore[no-untyped-def]
    """``await open_ledger(quotas, clock=None)``: a fresh ledger on this test's backend; cleaned up after."""
    opened: list[Ledger] = []
    url = backend_url(backend)

    async def make(quotas: Quotas | dict, clock: Callable[[], float] | None = None) -> Ledger:  # type: ignore[type-arg]
        if isinstance(quotas, dict):
            quotas = quotas_from_dict(quotas)
        ledger = await connect(url, quotas, clock)
        if backend == "redis_eval":
            assert isinstance(ledger, RedisLedger)
            ledger._scripts.run_as_eval()
        opened.append(ledger)
        return ledger

    yield make
    for ledger in opened:
        drop = getattr(ledger, "drop_schema", None) or getattr(ledger, "drop_keys", None)
        if drop is not None and ledger is opened[0]:
            await drop()
        await ledger.close()


@pytest.fixture
async def redis_ledgers(redis_url: str) -> AsyncIterator[Callable[..., Any]]:
    """``await redis_ledgers(quotas, clock=None, prefix=None, query="")``: a Redis ledger, on this test's fresh
    prefix unless ``prefix`` is given (two calls: two processes sharing one ledger), with more URL parameters
    in ``query``; keys dropped after."""
    opened: list[RedisLedger] = []
    default_prefix = f"fgt_{uuid.uuid4().hex[:12]}"

    async def make(
        quotas: Quotas, clock: Callable[[], float] | None = None, prefix: str | None = None, query: str = ""
    ) -> RedisLedger:
        ledger = await connect(f"{redis_url}?prefix={prefix or default_prefix}{query}", quotas, clock)
        assert isinstance(ledger, RedisLedger)
        opened.append(ledger)
        return ledger

    yield make
    for ledger in opened:
        await ledger.drop_keys()
        await ledger.close()


class FakeClock:
    """A clock the test moves by hand (ms since the epoch)."""

    def __init__(self, start_ms: float = 1_700_000_000_000.0) -> None:
        self.now_ms = start_ms

    def __call__(self) -> float:
        return self.now_ms

    def advance(self, seconds: float) -> None:
        self.now_ms += seconds * 1000.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


async def const(value: bool) -> bool:
    """An awaitable of ``value``: what an ``is_running`` callback given to ``expire_due`` returns."""
    return value
