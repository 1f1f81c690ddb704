"""The gateways' warnings while a stack runs: captured from the in-process gateway's logger, or read from
the processes' log files, and summarised as one line per kind (with a count) for a drill's report."""

from __future__ import annotations

import json
import logging
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class LogCapture(logging.Handler):
    """The warnings of the gateway's logger (``fairgate.gateway``) while a drill runs a gateway in this
    process; they are reported in the summary instead of printed. Only the logger's own handlers change."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        self._logger = logging.getLogger("fairgate.gateway")
        self._propagate = self._logger.propagate

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> LogCapture:
        self._logger.addHandler(self)
        self._logger.propagate = False
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)
        self._logger.propagate = self._propagate


LOG_WORDS = (
    "journal",
    "expired",
    "sweep",
    "settle_failed",
    "release_failed",
    "paused",
    "upstream",
    "Traceback",
    "Error",
)


def log_lines(captured: list[str], *logs: Path) -> list[str]:
    """Warning lines of the gateways: those captured in this process and those in process logs (the lines
    naming the journal, the sweep, settlements, upstreams or errors)."""
    lines = list(captured)
    for path in logs:
        if path.exists():
            lines += [
                line.strip()
                for line in path.read_text(errors="replace").splitlines()
                if any(word in line for word in LOG_WORDS)
            ]
    return lines


def summarise_log(lines: list[str], keep_whole: tuple[str, ...] = ("replayed",)) -> list[str]:
    """One line per kind of gateway warning, with a count; lines containing a ``keep_whole`` word each
    in full (e.g. the journal replay reports)."""
    counts: Counter[str] = Counter()
    firsts: dict[str, str] = {}
    whole = []
    for line in lines:
        if any(word in line for word in keep_whole):
            whole.append(line[:300])
            continue
        try:
            record = json.loads(line)
            kind = str(record.get("event"))
            text = f"{kind}: {record.get('error') or record.get('reservation') or ''}".rstrip(": ")
        except (ValueError, AttributeError):
            kind = line.split(":")[0][:80]
            text = line
        counts[kind] += 1
        firsts.setdefault(kind, text[:160])
    return whole + [f"{firsts[k]} (x{n})" if n > 1 else firsts[k] for k, n in counts.most_common()]


@contextmanager
def quiet_hang_ups() -> Iterator[None]:
    """While the block runs, leave out what clients hanging up by the hundred make this process log: servers
    writing to a connection that has just closed make asyncio log "socket.send() raised exception.", and
    streams abandoned mid-iteration make httpx's generators complain when they are finalised."""
    asyncio_log = logging.getLogger("asyncio")
    level, hook = asyncio_log.level, sys.unraisablehook

    def quiet(unraisable: Any) -> None:
        if not (isinstance(unraisable.exc_value, ValueError) and "already executing" in str(unraisable.exc_value)):
            hook(unraisable)

    asyncio_log.setLevel(logging.ERROR)
    sys.unraisablehook = quiet
    try:
        yield
    finally:
        asyncio_log.setLevel(level)
        sys.unraisablehook = hook


__all__ = ["LogCapture", "log_lines", "quiet_hang_ups", "summarise_log"]
