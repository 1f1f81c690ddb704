"""Shared fixtures: where the repository and the shared trace data are; the command line run as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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
