"""Shared fixtures: where the repository and the shared trace data are."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


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
