"""Shared fixtures: where the repository and the shared trace data are; the command line run as a user runs it;
the ledger servers.

PostgreSQL and Redis: ``$FAIRGATE_TEST_POSTGRES_URL`` / ``$FAIRGATE_TEST_REDIS_URL`` (default: the servers
on 127.0.0.1:5432, database ``test``, and 127.0.0.1:6379). Where none answers (a fresh machine), a
throwaway server is started from the installed binaries by pytest-postgresql / pytest-redis (Debian
packages ``postgresql`` and ``redis-server``). (pytest-postgresql's own launcher refuses to run as root, so
``fairgate.harness.postgres`` starts PostgreSQL as the ``postgres`` user instead.)
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest
from pytest_redis import factories as redis_factories

from fairgate.harness.postgres import throwaway_postgres

REPO = Path(__file__).resolve().parents[1]


def fairgate(*args: str, cwd: Path = REPO, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -m fairgate *args`` in ``cwd``, as a user runs it: its exit code and output (text)."""
    return subprocess.run(
        [sys.executable, "-m", "fairgate", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    """The real traces: ``$FAIRGATE_TRACES_DIR``, else ``../shared/data/traces`` beside the checkout."""
    path = Path(os.environ.get("FAIRGATE_TRACES_DIR", REPO.parent / "shared" / "data" / "traces"))
    assert path.is_dir(), f"trace directory {path} not found (set FAIRGATE_TRACES_DIR)"
    return path


@pytest.fixture(scope="session")
def seed_scenario():
    from fairgate.sim.scenario import load_scenario

    return load_scenario(REPO / "scenarios" / "seed.toml")


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
