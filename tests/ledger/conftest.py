"""Ledger backends for the conformance suite: a real SQLite file, a real PostgreSQL and a real Redis.

PostgreSQL and Redis: ``$FAIRGATE_TEST_POSTGRES_URL`` / ``$FAIRGATE_TEST_REDIS_URL`` (default: the servers
on 127.0.0.1:5432, database ``test``, and 127.0.0.1:6379). Where none answers (a fresh machine), a
throwaway server is started from the installed binaries by pytest-postgresql / pytest-redis (Debian
packages ``postgresql`` and ``redis-server``). Each test gets a fresh schema / key prefix, dropped after.
These tests are never skipped: a backend that cannot be reached fails them. (pytest-postgresql's own
launcher refuses to run as root, so ``fairgate.harness.postgres`` starts PostgreSQL as the
``postgres`` user instead.)
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from urllib.parse import urlparse

import pytest
from pytest_redis import factories as redis_factories

from fairgate.harness.postgres import throwaway_postgres
from fairgate.ledger import Ledger, Quotas, connect, quotas_from_dict

BACKENDS = ("sqlite", "postgres", "redis")


def _answers(url: str, default_port: int) -> bool:
    parts = urlparse(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or default_port), timeout=1.0):
            return True
    except OSError:
        return False


redis_throwaway = redis_factories.redis_proc(executable=shutil.which("redis-server") or "redis-server", port=None)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    url = os.environ.get("FAIRGATE_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
    if _answers(url, 5432):
        yield url
        return
    with throwaway_postgres() as throwaway:
        yield throwaway


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest) -> str:
    url = os.environ.get("FAIRGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    if _answers(url, 6379):
        return url
    proc = request.getfixturevalue("redis_throwaway")
    return f"redis://{proc.host}:{proc.port}/0"


def run_token() -> str:
    return f"fgt_{uuid.uuid4().hex[:12]}"


@pytest.fixture
def backend_url(request: pytest.FixtureRequest, tmp_path) -> Callable[[str], str]:  # type: ignore[no-untyped-def]
    """``backend_url(name)``: a fresh URL for backend ``name`` (a new file, schema or key prefix)."""
    token = run_token()

    def make(name: str) -> str:
        if name == "sqlite":
            return f"sqlite:///{tmp_path}/{token}.db"
        if name == "postgres":
            return f"{request.getfixturevalue('postgres_url')}?schema={token}"
        return f"{request.getfixturevalue('redis_url')}?prefix={token}"

    return make


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
        opened.append(ledger)
        return ledger

    yield make
    for ledger in opened:
        drop = getattr(ledger, "drop_schema", None) or getattr(ledger, "drop_keys", None)
        if drop is not None and ledger is opened[0]:
            await drop()
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
