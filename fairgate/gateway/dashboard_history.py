"""The dashboard's history on disk: its samples survive a restart (the time the gateway was down is a gap).

``[gateway].dashboard_history`` (default ``fairgate-dashboard.jsonl`` beside the configuration; ``""``: kept
in memory only) holds one JSON line per sample (``stats.Sample``): ``{"v": 1, "t_s", "tenants": {tenant
hash: [TenantPoint fields]}, "pools": {model: [PoolPoint fields]}, "busy": {upstream: fraction}}``. Tenants
are written as their hash (``tenant_tag``), as in every other file the gateway writes, and read back as the
configured names (a tenant no longer configured shows as its hash).

At start the last ``stats.MAX_SAMPLES`` samples are read back into the dashboard's series (a line that
does not parse is skipped, and counted in one warning). Samples are appended by a background task every
``FLUSH_EVERY_S`` seconds, off the event loop, and at shutdown; once the file holds ``COMPACT_FACTOR`` times
the samples kept, it is rewritten (atomically) with the last ones only. One file per process: two
processes writing one file would each read the other's samples as their own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import threading
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from fairgate.gateway.stats import PoolPoint, Sample, Stats, TenantPoint
from fairgate.ledger.base import tenant_tag

log = logging.getLogger("fairgate.gateway")
SCHEMA_VERSION = 1
FLUSH_EVERY_S = 5.0
COMPACT_FACTOR = 4


def encode(sample: Sample) -> str:
    """One sample as its JSON line (module docstring), tenants hashed; no newline."""
    document = {
        "v": SCHEMA_VERSION,
        "t_s": round(sample.t_s, 3),
        "tenants": {tenant_tag(name): list(point) for name, point in sample.tenants.items()},
        "pools": {model: list(point) for model, point in sample.pools.items()},
        "busy": sample.busy,
    }
    return json.dumps(document, separators=(",", ":"), allow_nan=False)


def decode(line: str, names: Mapping[str, str]) -> Sample:
    """The sample of one line, tenant hashes read back through ``names`` (hash -> name). Raises
    ``ValueError``, ``TypeError``, ``KeyError`` for a line that is not one (the caller skips it)."""
    document = json.loads(line)
    if document["v"] != SCHEMA_VERSION:
        raise ValueError(f"format version {document['v']!r}")
    tenants = {names.get(tag, tag): TenantPoint(*point) for tag, point in document["tenants"].items()}
    pools = {model: PoolPoint(*point) for model, point in document["pools"].items()}
    busy = {str(name): (None if value is None else float(value)) for name, value in document["busy"].items()}
    return Sample(float(document["t_s"]), tenants, pools, busy)


class History:
    """The file behind the dashboard's samples (module docstring).

    Args:
        path: the JSON-lines file (its folder is created).
        tenants: the configured tenant names (to read hashes back as names).
        keep: how many samples are read back, and kept when the file is compacted.
    """

    def __init__(self, path: Path, tenants: Iterable[str], keep: int) -> None:
        self.path, self.keep = path, keep
        self._names = {tenant_tag(name): name for name in tenants}
        self._pending: list[str] = []
        self._lock = threading.Lock()
        self._lines = 0  # lines in the file, as far as this process knows
        self.failing = False  # the last write failed (warned once until one succeeds)

    def load(self) -> list[Sample]:
        """The last ``keep`` samples of the file (none when it does not exist). Raises ``OSError``."""
        if not self.path.exists():
            return []
        lines = self.path.read_text(encoding="utf-8").splitlines()
        self._lines = len(lines)
        samples, skipped = [], 0
        for line in lines[-self.keep :]:
            try:
                samples.append(decode(line, self._names))
            except (ValueError, TypeError, KeyError):
                skipped += 1
        if skipped:
            log.warning("dashboard history %s: %d lines skipped (not a sample)", self.path, skipped)
        return samples

    def rename(self, tenants: Iterable[str]) -> None:
        """Read hashes back as these tenants' names from now on (a configuration reload)."""
        self._names = {tenant_tag(name): name for name in tenants}

    def add(self, sample: Sample) -> None:
        """Queue ``sample`` for the next ``flush`` (on the event loop: no I/O)."""
        line = encode(sample)
        with self._lock:
            self._pending.append(line)

    def flush(self) -> None:
        """Append the samples queued, compacting the file when it is long (blocking: not on the event loop).
        Raises ``OSError``; the samples stay queued then."""
        with self._lock:
            lines, self._pending = self._pending, []
        if not lines:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as file:
                file.write("".join(line + "\n" for line in lines))
        except OSError:
            with self._lock:
                self._pending[:0] = lines
            raise
        self._lines += len(lines)
        if self._lines > COMPACT_FACTOR * self.keep:
            self._compact()

    def _compact(self) -> None:
        kept = self.path.read_text(encoding="utf-8").splitlines()[-self.keep :]
        fd, temporary = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write("".join(line + "\n" for line in kept))
        os.replace(temporary, self.path)
        self._lines = len(kept)


def install(app: FastAPI, path: Path | None, tenants: Iterable[str], stats: Stats) -> History | None:
    """Keep ``stats``' samples in the file at ``path`` (None: nothing): read back when ``app`` starts, then
    appended while it runs (module docstring). Returns the history, for a reload to ``rename``."""
    if path is None:
        return None
    history = History(path, tenants, stats.samples.maxlen or len(stats.samples))
    inner = app.router.lifespan_context

    async def flush_often() -> None:
        while True:
            await asyncio.sleep(FLUSH_EVERY_S)
            await _flush(history)

    @asynccontextmanager
    async def lifespan(running: Any) -> AsyncIterator[Any]:
        try:
            stats.samples.extend(await asyncio.to_thread(history.load))
        except OSError as exc:
            log.warning("dashboard history %s not read: %s", path, exc)
        stats.on_sample = history.add
        task = asyncio.ensure_future(flush_often())
        try:
            async with inner(running) as state:
                yield state
        finally:
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
            await _flush(history)

    app.router.lifespan_context = lifespan
    return history


async def _flush(history: History) -> None:
    try:
        await asyncio.to_thread(history.flush)
    except OSError as exc:
        if not history.failing:  # once, not every FLUSH_EVERY_S while the disk refuses
            log.warning("dashboard history %s not written (samples kept in memory): %s", history.path, exc)
        history.failing = True
    else:
        history.failing = False


__all__ = ["History", "decode", "encode", "install"]
