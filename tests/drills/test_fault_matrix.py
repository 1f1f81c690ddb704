"""The fault matrix (``fairgate.drills.matrix``): two ``fairgate serve`` processes x {SQLite (one file),
PostgreSQL, Redis} x {retries to both processes, kill -9 of one gateway, the ledger stopped 10 s, the ledger
paused 5 s, a replica killed, client cuts}; in each cell the history checker holds every request id to the
ledger and the replicas. Each cell takes 10-30 s on the shared two-core machine (a fresh stack of four
processes and a throwaway ledger server each); the matrix about 5 minutes.

The table (cell -> requests, fault, client outcomes, discrepancies) is printed at the end of the module
(``-s``), and written to ``$FAIRGATE_MATRIX_TABLE`` when set (docs/drills.md holds the one measured).

A cell that fails on a defect named precisely is a strict expected failure, its reason the discrepancy."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from fairgate.drills.matrix import BACKENDS, FAULTS, NOT_APPLICABLE, CellResult, run_cell, table
from fairgate.gateway.call import SETTLE_EVERY_TOKENS

CELL_WALL_S_MAX = 60.0
RESULTS: list[CellResult] = []

# The defects the matrix finds, as the xfail reasons of the cells they fail (none open now).
EXPECTED_FAILURES: dict[tuple[str, str], str] = {}


def _cells() -> list[object]:
    out: list[object] = []
    for backend in BACKENDS:
        for fault in FAULTS:
            marks = [pytest.mark.serial]
            if (backend, fault) in EXPECTED_FAILURES:
                marks.append(pytest.mark.xfail(strict=True, reason=EXPECTED_FAILURES[(backend, fault)]))
            if (backend, fault) in NOT_APPLICABLE:
                marks.append(pytest.mark.skip(reason=NOT_APPLICABLE[(backend, fault)]))
            out.append(pytest.param(backend, fault, marks=marks, id=f"{backend}-{fault}"))
    return out


@pytest.fixture(scope="module", autouse=True)
def matrix_table() -> Iterator[None]:
    """Print the table of the cells run (and write it to ``$FAIRGATE_MATRIX_TABLE``) when the module ends."""
    yield
    if not RESULTS:
        return
    na = [CellResult(b, f, why, {}, None, 0.0) for (b, f), why in NOT_APPLICABLE.items()]
    text = table(RESULTS + na)
    print("\n" + text)
    path = os.environ.get("FAIRGATE_MATRIX_TABLE")
    if path:
        Path(path).write_text(text + "\n")


@pytest.mark.parametrize(("backend", "fault"), _cells())
def test_the_history_holds_under_the_fault(backend: str, fault: str):
    result = run_cell(backend, fault)
    RESULTS.append(result)
    report = result.report
    assert report is not None
    # The cell ran what it says: its ids, each answered or failed (none still running), the fault injected.
    assert report.requests == 30 and report.attempts >= 30, result.row
    assert "running" not in result.outcomes, result.row
    assert result.outcomes.get("ok", 0) > 0, result.row
    assert result.wall_s <= CELL_WALL_S_MAX, f"the cell took {result.wall_s:.0f} s"
    if fault == "kill9":
        # Streams longer than the settle cadence's bound were cut: a gateway settling less often than every
        # 64 tokens (or 0.5 s) would leave more than 64 delivered unbilled, which the checker flags.
        assert result.longest > SETTLE_EVERY_TOKENS, result.row
    # The claim: the checker, and both gateways' gauges back to 0 (nothing queued or running).
    assert report.ok, f"{result.row}\n{report.table()}"
    assert set(result.gauges) == {"A", "B"} and not result.held, result.row
    assert result.ok
