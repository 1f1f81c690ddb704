"""What the drill tests share: a drill run timed against its wall-time bound."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fairgate.drills.report import DrillResult

R = TypeVar("R", bound=DrillResult)


@dataclass(frozen=True)
class TimedRun(Generic[R]):
    """A drill's result, its wall time in seconds and its ``summary()`` (the assertion messages)."""

    result: R
    elapsed_s: float
    summary: str

    def assert_within(self, wall_s_max: float) -> None:
        """The drill's run took at most ``wall_s_max`` seconds of wall time."""
        assert self.elapsed_s <= wall_s_max, f"the drill took {self.elapsed_s:.0f} s"


def timed_run(run: Callable[..., R], *args: Any) -> TimedRun[R]:
    """``run(*args)`` (a drill's ``run(options[, config])``), timed."""
    start = time.monotonic()
    result = run(*args)
    elapsed_s = time.monotonic() - start
    return TimedRun(result, elapsed_s, result.summary())


def assert_closed_loop_history(history: Any, sent: int) -> None:
    """The history checker's verdict on a closed-loop load of ``sent`` requests (each sent once, no retries):
    every request checked, at most one reservation each, no discrepancy."""
    assert history is not None
    assert history.requests == history.attempts == sent > 100, history.table()
    assert 0 < history.reservations <= sent, history.table()
    assert history.discrepancies == (), history.table()
