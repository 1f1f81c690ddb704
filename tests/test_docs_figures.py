"""The figures the README quotes are generated, and current: its tables are what scripts/readme_figures.py
renders from docs/ (written by `bash scripts/figures`), and the deterministic runs behind them - the seed
study and the flood sweep - give the same figures when run again now."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, fairgate


def test_the_readme_tables_are_the_ones_rendered_from_docs() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "readme_figures.py"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr
    readme = (REPO / "README.md").read_text()
    assert readme.count("<!-- figures:") == 3 and readme.count("<!-- /figures -->") == 3


def test_the_seed_study_in_docs_is_what_the_simulator_computes_now(tmp_path: Path) -> None:
    out = tmp_path / "seed.md"
    done = fairgate("simulate", "scenarios/seed.toml", "--policy", "all", "--seeds", "1-5", "--markdown", str(out))
    assert done.returncode == 0, done.stderr
    assert out.read_text() == (REPO / "docs" / "seed_study.md").read_text()


def test_the_flood_sweep_in_docs_is_what_the_simulator_computes_now(tmp_path: Path) -> None:
    out = tmp_path / "flood.json"
    done = fairgate("sweep", "scenarios/seed.toml", "--grid", "scenarios/flood.toml", "--json", str(out))
    assert done.returncode == 0, done.stderr
    fresh, kept = json.loads(out.read_text()), json.loads((REPO / "docs" / "flood.json").read_text())
    assert fresh["configurations"] == kept["configurations"]
