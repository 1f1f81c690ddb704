"""Structured request log, JSON lines: one record per decision and outcome of a request.

The file is ``[gateway].event_log`` (``GatewayConfig.event_log_path``; default ``fairgate-events.jsonl``
beside the config; unset or empty: no file). Every record is also logged, as the same JSON text, by the
``fairgate.gateway`` logger at INFO, so a log pipeline gets it without reading the file.

Format: UTF-8, one JSON object per line (``\\n``). Keys of every record:

- ``v``: the format version (``2``; version 1 is read too, below); ``event``: the record kind (below);
- ``ts``: when it happened, wall-clock seconds since the Unix epoch (float, ms precision);
  ``time``: the same instant as ISO 8601 UTC with milliseconds (``2025-01-31T12:00:01.123Z``).

Request records also carry ``request_id`` (as the client sent it or as generated), ``tenant_hash`` (the
tenant's stable 16-hex-digit ``tenant_tag``; ``null`` when no credential identified it), ``delegate_hash``
(the delegate service's tag for on-behalf-of calls, else ``null``) and ``model`` (``null`` if unread). A raw
tenant name is never written: quoted tenant names in error messages are replaced by ``tenant:<hash>``.

=================  ==============================================================================================
``admitted``       a reservation was made; the request joins its tenant's queue: ``reservation_id``, ``key_id``
                   (the key it came with: its stored hash's first 19 characters, a prefix of ``fairgate keys list``'s),
                   ``input_tokens`` (the gateway's count of the prompt), ``max_output_tokens``, ``gpu_ms_estimate``
                   (GPU ms reserved).
``rejected``       answered with an error instead of running: ``reason`` (``observe.REJECT_REASONS``),
                   ``status`` (HTTP), ``code`` (the OpenAI error code, ``null`` if unknown), ``message`` (as sent to
                   the client), ``dimension`` (the quota dimension of a quota rejection, else ``null``),
                   ``after_admission`` (true: it had been admitted, e.g. ``queue_full``), ``retry_after_s``
                   (the Retry-After base in seconds, before jitter; ``null`` if none or unknown), ``key_id`` (the
                   key it came with, as ``admitted``'s; ``null`` when none was valid).
``dispatched``     the fair policy gave it a slot: ``upstream`` (its name), ``queue_ms`` (time in the queue).
``finished``       the upstream call ended: ``upstream``, ``outcome`` (``completed`` / ``cancelled``: the client went
                   away / ``error``), ``queue_ms``, ``ttft_incl_queue_ms`` (time to first token from admission -
                   the request joining its tenant's queue - so the queue included: ``queue_ms`` +
                   ``first_token_after_dispatch_ms``; the TTFT of ``/metrics``, the dashboard, the access log
                   and ``fairgate report``; ``null``: no token), ``first_token_after_dispatch_ms`` (from
                   dispatch to the first token: the upstream's part; ``null``: no token),
                   ``tpot_ms`` (mean ms per output token after the first; ``null``), ``input_tokens``,
                   ``output_tokens`` and ``gpu_ms`` (what was billed), ``gpu_ms_estimate`` and
                   ``max_output_tokens`` (what was reserved), ``spend_micros`` (what the billed usage cost at the
                   reservation's price, micros of the ``[quotas.pricing]`` currency; absent in older logs),
                   ``cached_tokens`` and ``cache_credit_gpu_ms`` (prompt tokens the engine read from its prefix
                   cache, and the GPU ms of prefill taken off ``gpu_ms`` for them: ``fairgate.core.prefix_cache``;
                   absent when none, and in older logs).
``left``           the client left while the request was queued: ``queue_ms`` (its time in the queue); it never
                   ran, its reservation was released, nothing was billed.
``usage``          the GPU time the live meter charged per tenant on one model's upstreams since ``since``
                   (epoch seconds) until ``ts``: ``model``, ``gpu_ms`` (``{tenant_hash: ms}``). Written every
                   ``USAGE_EVERY_S`` seconds while GPU time is charged, and at shutdown: the per-token charges
                   themselves are not logged, these aggregates are enough to plot shares over time.
``started``        a gateway process started: ``pid``, ``policy``, ``upstreams`` (``[{name, model, max_batch}]``),
                   ``tenants`` (``{tenant_hash: {weight, priority}}``).
``reloaded``       that process applied a configuration reload (``pid``): ``tenants`` as in ``started``, now.
``stopped``        that process stopped (``pid``; its log was flushed and closed).
=================  ==============================================================================================

Readers must ignore records of an unknown ``event`` (later versions may add kinds) and unknown keys.
Version 1 differs in one key: its ``finished`` records hold ``ttft_ms`` (dispatch to first token) instead of
the two TTFT keys; ``read_records`` gives them both (``first_token_after_dispatch_ms`` = ``ttft_ms``, and
``ttft_incl_queue_ms`` = ``queue_ms`` + ``ttft_ms``), so a reader sees one shape.

Writing never blocks the event loop: the observer turns each event into a line and appends it to an
in-memory buffer; a writer thread appends the buffer to the file with one ``write`` call at least every
``FLUSH_EVERY_S`` second (sooner when ``FLUSH_LINES`` lines are waiting) and once more at shutdown, then
logs the lines. If the disk stalls, at most ``MAX_PENDING_LINES`` lines wait; later ones are dropped and
counted (a warning says how many). Size cap: when the file would exceed ``MAX_BYTES`` (100 MiB), it is
renamed ``<file>.1`` (``.1`` to ``.2`` and so on, ``BACKUPS`` = 5 kept, the oldest deleted) and a new file
is started, so the log takes at most 6 x 100 MiB. Several gateway processes may share one file: each
appends whole batches with one ``O_APPEND`` write, and a writer that finds the file rotated by another
reopens it rather than rotating again (records of different processes may then be out of ``ts`` order).
``read_records`` reads a log with its rotated predecessors, oldest file first.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from fairgate.gateway.config import GatewayConfig
from fairgate.gateway.observe import Admitted, Charged, Dispatched, Event, Fanout, Finished, Left, Rejected
from fairgate.inputfile import open_regular
from fairgate.ledger.base import tenant_tag
from fairgate.ledger.config import TenantQuota

log = logging.getLogger("fairgate.gateway")

SCHEMA_VERSION = 2
FLUSH_EVERY_S = 1.0  # the longest a record waits in memory
FLUSH_LINES = 2_000  # write sooner when this many lines wait
USAGE_EVERY_S = 5.0  # how often per-tenant GPU-time aggregates are written
MAX_BYTES = 100 * 1024 * 1024  # rotate before the file grows past this size (bytes)
BACKUPS = 5  # rotated files kept: <file>.1 (newest) ... <file>.5
MAX_PENDING_LINES = 100_000  # lines waiting for the writer beyond this are dropped (and counted)
_DELEGATES_KEPT = 100_000  # (tenant, request id) -> delegate of admitted requests not finished yet

REQUEST_EVENTS = ("admitted", "rejected", "dispatched", "finished", "left")


class EventLogError(ValueError):
    """An unreadable request log; ``str()`` is one line ``<file>:<line>: <problem>`` (or ``<file>: <problem>``)."""


@lru_cache(maxsize=65_536)
def _tag(tenant: str) -> str:
    return tenant_tag(tenant)


def _hash(tenant: str | None) -> str | None:
    return None if tenant is None else _tag(tenant)


def iso_time(ts: float) -> str:
    """``ts`` (epoch seconds) as ISO 8601 UTC with milliseconds, e.g. ``2025-01-31T12:00:01.123Z``."""
    ms = round(ts * 1000)
    return _iso_second(ms // 1000) + f"{ms % 1000:03d}Z"


@lru_cache(maxsize=1_024)
def _iso_second(second: int) -> str:
    # Records of one second share this prefix; strftime was ~15 us of each record's ~45 us (bench/eventlog_loop.py).
    return datetime.fromtimestamp(second, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.")


def _cache_fields(event: Finished) -> dict[str, Any]:
    """A finished record's prefix-cache keys: none when nothing of its prompt was cached."""
    if not event.cached_tokens:
        return {}
    return {"cached_tokens": event.cached_tokens, "cache_credit_gpu_ms": _ms(event.cache_credit_gpu_ms)}


def _sum_ms(a: float | None, b: float | None) -> float | None:
    """Two durations as written (``_ms``) added, so that a record's own figures add up to the last µs; None
    when either is."""
    return None if a is None or b is None else round(a + b, 3)


def _ms(value: float | None) -> float | None:
    """A duration rounded to 1 µs (``None`` stays ``None``; a non-finite value becomes ``None``)."""
    if value is None or not math.isfinite(value):
        return None
    return round(value, 3)


class _Scrubber:
    """Replaces tenant names in free text (error messages) by ``tenant:<hash>``: every configured tenant
    name in quotes (as ``repr`` writes it), and the event's own tenant and delegate anywhere as a word."""

    def __init__(self, tenants: Iterable[str]) -> None:
        quoted = sorted({repr(name) for name in tenants} | {f'"{name}"' for name in tenants}, key=len, reverse=True)
        self._quoted = re.compile("|".join(re.escape(q) for q in quoted)) if quoted else None

    def __call__(self, text: str, *names: str | None) -> str:
        if self._quoted is not None:
            text = self._quoted.sub(lambda m: f"'tenant:{_tag(_unquote(m.group(0)))}'", text)
        for name in names:
            if name and name in text:
                text = re.sub(rf"(?<![\w-]){re.escape(name)}(?![\w-])", f"tenant:{_tag(name)}", text)
        return text


def _unquote(quoted: str) -> str:
    if quoted.startswith(("'", '"')):
        import ast

        try:
            value = ast.literal_eval(quoted)
            if isinstance(value, str):
                return value
        except (ValueError, SyntaxError):
            pass
        return quoted[1:-1]
    return quoted


class EventLog:
    """The request log's observer and writer (see the module docstring for the format).

    Args:
        path: the JSON-lines file (its folder is created); None: no file, records only go to the logger.
        tenants: the configured tenant names (scrubbed from messages).
        flush_every_s / usage_every_s: seconds between writes / between ``usage`` records.
        max_bytes / backups: the size cap (bytes) and how many rotated files are kept.
        clock: wall-clock seconds since the epoch (for ``usage`` and ``started`` records).
    """

    def __init__(
        self,
        path: Path | None,
        tenants: Iterable[str] = (),
        *,
        flush_every_s: float = FLUSH_EVERY_S,
        usage_every_s: float = USAGE_EVERY_S,
        max_bytes: int = MAX_BYTES,
        backups: int = BACKUPS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.flush_every_s = flush_every_s
        self.usage_every_s = usage_every_s
        self.max_bytes = max_bytes
        self.backups = backups
        self._clock = clock
        self._scrub = _Scrubber(tenants)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        # Events wait as they are and become JSON lines in the writer thread: the event loop only appends
        # (formatting a record costs ~10-20 us of the loop's time per request event otherwise).
        self._pending: list[Event | dict[str, Any]] = []
        self._queued = 0  # lines ever queued
        self._done = 0  # lines ever handed to the file and the logger
        self._dropped = 0
        self._usage: dict[tuple[str, str], float] = {}  # (model, tenant) -> GPU ms since _usage_since
        self._usage_since = clock()
        self._delegates: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._flushing = False  # flush() asked for a write now
        self._closed = False
        self._fd: int | None = None
        self._size = 0
        self._failed = False  # the file could not be opened or written (reported once)

    # -- the observer (event loop) -------------------------------------------------------------------------

    def observe(self, event: Event) -> None:
        """Queue ``event`` for the writer thread, which turns it into a record (``Charged`` only adds to the
        ``usage`` aggregates here). Quick, never raises."""
        if isinstance(event, Charged):
            if event.gpu_ms > 0 and math.isfinite(event.gpu_ms):
                key = (event.model, event.tenant)
                with self._lock:
                    self._usage[key] = self._usage.get(key, 0.0) + event.gpu_ms
            return
        if isinstance(event, Admitted | Rejected | Dispatched | Finished | Left):
            self.write(event)

    def record_of(self, event: Event) -> dict[str, Any] | None:
        """The log record of a request event (``None`` for ``Charged`` and unknown events). Keeps the request's
        delegate between its events: call it in the events' order (the writer thread does)."""
        if isinstance(event, Admitted):
            if event.delegate is not None:
                self._delegates[(event.tenant, event.request_id)] = event.delegate
                while len(self._delegates) > _DELEGATES_KEPT:
                    self._delegates.popitem(last=False)
            return self._request(
                "admitted",
                event,
                event.delegate,
                reservation_id=event.reservation_id,
                key_id=event.key_id,
                input_tokens=event.input_tokens,
                max_output_tokens=event.max_output_tokens,
                gpu_ms_estimate=_ms(event.gpu_ms_estimate),
            )
        if isinstance(event, Rejected):
            delegate = None
            if event.tenant is not None and event.after_admission:
                delegate = self._delegates.pop((event.tenant, event.request_id), None)
            retry = getattr(event, "retry_after_s", None)
            return self._request(
                "rejected",
                event,
                delegate,
                reason=event.reason,
                status=event.status,
                code=getattr(event, "code", None),
                message=self._scrub(event.message, event.tenant, delegate),
                dimension=event.dimension,
                after_admission=event.after_admission,
                retry_after_s=None if retry is None else float(retry),
                key_id=getattr(event, "key_id", None),
            )
        if isinstance(event, Left):
            delegate = self._delegates.pop((event.tenant, event.request_id), None)
            return self._request("left", event, delegate, queue_ms=_ms(event.queue_ms))
        if isinstance(event, Dispatched):
            delegate = self._delegates.get((event.tenant, event.request_id))
            return self._request("dispatched", event, delegate, upstream=event.upstream, queue_ms=_ms(event.queue_ms))
        if isinstance(event, Finished):
            delegate = self._delegates.pop((event.tenant, event.request_id), None)
            return self._request(
                "finished",
                event,
                delegate,
                upstream=event.upstream,
                outcome=event.outcome,
                queue_ms=_ms(event.queue_ms),
                ttft_incl_queue_ms=_sum_ms(_ms(event.queue_ms), _ms(event.ttft_ms)),
                first_token_after_dispatch_ms=_ms(event.ttft_ms),
                tpot_ms=_ms(event.tpot_ms),
                input_tokens=event.input_tokens,
                output_tokens=event.output_tokens,
                gpu_ms=_ms(event.gpu_ms),
                gpu_ms_estimate=_ms(event.gpu_ms_estimate),
                max_output_tokens=event.max_output_tokens,
                spend_micros=round(event.spend_micros, 3),
                **_cache_fields(event),
            )
        return None

    @staticmethod
    def _request(
        kind: str, event: Admitted | Rejected | Dispatched | Finished | Left, delegate: str | None, **fields: Any
    ) -> dict[str, Any]:
        return {
            "v": SCHEMA_VERSION,
            "event": kind,
            "ts": round(event.time_s, 3),
            "time": iso_time(event.time_s),
            "request_id": event.request_id,
            "tenant_hash": _hash(event.tenant),
            "delegate_hash": _hash(delegate),
            "model": event.model,
            **fields,
        }

    def write(self, record: dict[str, Any] | Event) -> None:
        """Queue ``record`` (a JSON-serialisable dict, or a request event) for the writer thread."""
        with self._wake:
            if self._closed:
                self._emit(self._lines([record]))  # after shutdown (rare): write at once
                if self._fd is not None:
                    os.close(self._fd)
                    self._fd = None
                return
            if self.path is None and not log.isEnabledFor(logging.INFO):
                return  # nobody would see it
            if len(self._pending) >= MAX_PENDING_LINES:
                self._dropped += 1
                return
            self._pending.append(record)
            self._queued += 1
            if len(self._pending) >= FLUSH_LINES:
                self._wake.notify_all()
        if self._thread is None:
            self.start()  # used without the app's lifespan (the app starts it otherwise)

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def start(self, started: dict[str, Any] | None = None) -> None:
        """Start the writer thread (idempotent); write a ``started`` record with the fields of ``started``."""
        with self._wake:
            if self._thread is not None:
                return
            self._closed = self._stopping = False
            self._usage_since = self._clock()
            self._thread = threading.Thread(target=self._run, name="fairgate-eventlog", daemon=True)
            self._thread.start()
        if started is not None:
            now = self._clock()
            self.write(
                {
                    "v": SCHEMA_VERSION,
                    "event": "started",
                    "ts": round(now, 3),
                    "time": iso_time(now),
                    "pid": os.getpid(),
                    **started,
                }
            )

    def reconfigure(self, tenants: Mapping[str, TenantQuota]) -> None:
        """A configuration reload: scrub ``tenants``' names from messages from now on, and write a ``reloaded``
        record with their weights and priorities."""
        self._scrub = _Scrubber(tenants)  # one assignment: the writer thread sees the old or the new one
        now = self._clock()
        record = {"v": SCHEMA_VERSION, "event": "reloaded", "ts": round(now, 3), "time": iso_time(now)}
        self.write({**record, "pid": os.getpid(), "tenants": _shares(tenants)})

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Have every record queued so far written now; wait up to ``timeout_s`` seconds (blocking: not on the
        event loop). Returns whether they were written in time (true when no writer runs)."""
        deadline = time.monotonic() + timeout_s
        with self._wake:
            target = self._queued
            if self._thread is None:
                return True
            self._flushing = True
            self._wake.notify_all()
            while self._done < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(left)
        return True

    def close(self) -> None:
        """Write the last ``usage`` aggregates and a ``stopped`` record, flush, stop the thread, close the file.
        Blocks until written (call it off the event loop, e.g. with ``asyncio.to_thread``)."""
        with self._wake:
            thread, self._stopping = self._thread, True
            self._wake.notify_all()
        if thread is not None:
            thread.join()  # its last pass writes what waits, the usage aggregates and the stopped record
        with self._wake:
            if thread is None and not self._closed:
                self._emit(self._lines(self._pending) + self._usage_lines(force=True) + [self._stopped_line()])
                self._pending = []
            self._thread = None
            self._closed = True
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _stopped_line(self) -> str:
        now = self._clock()
        return json.dumps(
            {"v": SCHEMA_VERSION, "event": "stopped", "ts": round(now, 3), "time": iso_time(now), "pid": os.getpid()},
            separators=(",", ":"),
        )

    # -- the writer thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        next_flush = time.monotonic() + self.flush_every_s
        while True:
            with self._wake:
                while not self._stopping and not self._flushing and len(self._pending) < FLUSH_LINES:
                    left = next_flush - time.monotonic()
                    if left <= 0:
                        break
                    self._wake.wait(left)
                stopping = self._stopping
                records, self._pending = self._pending, []
                done = self._queued
                dropped, self._dropped = self._dropped, 0
                usage = self._usage_lines(force=stopping)
                if stopping:
                    usage.append(self._stopped_line())
            next_flush = time.monotonic() + self.flush_every_s
            if dropped:
                log.warning("request log: %d records dropped (the writer fell behind)", dropped)
            try:
                self._emit(self._lines(records) + usage)
            except Exception:
                log.exception("request log: writing failed")
            with self._wake:
                self._done = done
                self._flushing = False
                self._wake.notify_all()
            if stopping:
                return

    def _lines(self, records: list[Event | dict[str, Any]]) -> list[str]:
        """JSON lines of ``records`` (the writer thread's work; a record that cannot be formatted is logged and
        skipped, never stops the others)."""
        lines = []
        for item in records:
            try:
                record = item if isinstance(item, dict) else self.record_of(item)
                if record is not None:
                    lines.append(json.dumps(record, ensure_ascii=False, allow_nan=False, separators=(",", ":")))
            except (TypeError, ValueError):
                log.exception("request log: a record could not be written")
        return lines

    def _usage_lines(self, force: bool) -> list[str]:
        """``usage`` records of the GPU time charged since the last ones (called with the lock held)."""
        now = self._clock()
        if not self._usage or (not force and now - self._usage_since < self.usage_every_s):
            return []
        by_model: dict[str, dict[str, float]] = {}
        for (model, tenant), gpu_ms in self._usage.items():
            by_model.setdefault(model, {})[_tag(tenant)] = round(gpu_ms, 3)
        since, self._usage_since, self._usage = self._usage_since, now, {}
        return [
            json.dumps(
                {
                    "v": SCHEMA_VERSION,
                    "event": "usage",
                    "ts": round(now, 3),
                    "time": iso_time(now),
                    "since": round(since, 3),
                    "model": model,
                    "gpu_ms": tenants,
                },
                ensure_ascii=False,
                allow_nan=False,
                separators=(",", ":"),
            )
            for model, tenants in by_model.items()
        ]

    def _emit(self, lines: list[str]) -> None:
        if not lines:
            return
        if self.path is not None:
            self._append(("\n".join(lines) + "\n").encode("utf-8"))
        if log.isEnabledFor(logging.INFO):
            for line in lines:
                log.info(line)

    def _append(self, data: bytes) -> None:
        """Append ``data`` with one ``write`` (whole lines), rotating first if the file would pass the cap."""
        try:
            if self._fd is None:
                self._open()
            assert self._fd is not None
            if self._still_over(len(data)):
                self._rotate()
            view = memoryview(data)
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
                self._size += written
            self._failed = False
        except OSError as exc:
            if not self._failed:
                log.error(
                    "request log %s: cannot write (%s); records are lost until it works again",
                    self.path,
                    exc.strerror or exc,
                )
            self._failed = True
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _open(self) -> None:
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        self._size = os.fstat(self._fd).st_size

    def _still_over(self, adding: int) -> bool:
        """Whether the file at ``path`` is too full for ``adding`` more bytes (its real size, with what other
        processes appended; one ``stat`` per write); when another process has rotated it already, this writer
        reopens the new file instead."""
        assert self.path is not None and self._fd is not None
        mine = os.fstat(self._fd)
        try:
            current = os.stat(self.path)
        except FileNotFoundError:
            current = None
        if current is None or (current.st_ino, current.st_dev) != (mine.st_ino, mine.st_dev):
            os.close(self._fd)
            self._fd = None
            self._open()
        else:
            self._size = current.st_size
        return self._size > 0 and self._size + adding > self.max_bytes

    def _rotate(self) -> None:
        assert self.path is not None and self._fd is not None
        os.close(self._fd)
        self._fd = None
        if self.backups <= 0:
            self.path.unlink(missing_ok=True)
        else:
            for index in range(self.backups - 1, 0, -1):
                older = _rotated(self.path, index)
                if older.exists():
                    os.replace(older, _rotated(self.path, index + 1))
            os.replace(self.path, _rotated(self.path, 1))
        self._open()


def _shares(tenants: Mapping[str, TenantQuota]) -> dict[str, dict[str, Any]]:
    """The ``tenants`` field of ``started`` and ``reloaded``: tenant hash -> weight and priority."""
    return {_tag(name): {"weight": t.weight, "priority": t.priority} for name, t in tenants.items()}


def _rotated(path: Path, index: int) -> Path:
    return path.with_name(f"{path.name}.{index}")


def install(app: FastAPI, config: GatewayConfig, events: Fanout) -> EventLog:
    """Add the request log to the gateway ``app``: its observer on ``events``, and a wrapper around the app's
    lifespan that starts the writer (with a ``started`` record) and, at shutdown, after the app's own
    clean-up, flushes and closes the log. Returns the log."""
    tenants = dict(config.quotas.tenants)
    event_log = EventLog(
        config.event_log_path,
        tenants,
        max_bytes=getattr(config.gateway, "event_log_max_bytes", None) or MAX_BYTES,
        backups=getattr(config.gateway, "event_log_backups", BACKUPS),
    )
    events.add(event_log)
    started = {
        "policy": config.gateway.policy,
        "upstreams": [{"name": u.name, "model": u.model, "max_batch": u.max_batch} for u in config.upstreams],
        "tenants": _shares(tenants),
        "currency": config.quotas.currency,
    }
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(running: Any) -> AsyncIterator[Any]:
        event_log.start(started)
        try:
            async with inner(running) as state:
                yield state
        finally:
            await asyncio.to_thread(event_log.close)

    app.router.lifespan_context = lifespan
    return event_log


# -- reading ------------------------------------------------------------------------------------------------------

_NUMBER = (int, float)
_FIELDS: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {  # key -> (types, may be null)
    "admitted": {
        "input_tokens": ((int,), False),
        "max_output_tokens": ((int,), False),
        "gpu_ms_estimate": (_NUMBER, False),
    },
    "rejected": {
        "reason": ((str,), False),
        "status": ((int,), False),
        "message": ((str,), False),
        "dimension": ((str,), True),
        "after_admission": ((bool,), False),
    },
    "dispatched": {"upstream": ((str,), False), "queue_ms": (_NUMBER, False)},
    "finished": {
        "upstream": ((str,), False),
        "outcome": ((str,), False),
        "queue_ms": (_NUMBER, False),
        "ttft_incl_queue_ms": (_NUMBER, True),
        "first_token_after_dispatch_ms": (_NUMBER, True),
        "tpot_ms": (_NUMBER, True),
        "input_tokens": ((int,), False),
        "output_tokens": ((int,), False),
        "gpu_ms": (_NUMBER, False),
        "gpu_ms_estimate": (_NUMBER, False),
        "max_output_tokens": ((int,), False),
    },
    "left": {"queue_ms": (_NUMBER, False)},
    "usage": {"since": (_NUMBER, False), "model": ((str,), False), "gpu_ms": ((dict,), False)},
    "started": {},
    "reloaded": {},
    "stopped": {},
}
_OPTIONAL: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "rejected": {"retry_after_s": (_NUMBER, True), "code": ((str,), True), "key_id": ((str,), True)},
    "admitted": {"key_id": ((str,), True)},
    "finished": {
        "spend_micros": (_NUMBER, False),
        "cached_tokens": ((int,), False),
        "cache_credit_gpu_ms": (_NUMBER, False),
    },
}
_REQUEST_KEYS: dict[str, tuple[tuple[type, ...], bool]] = {
    "request_id": ((str,), False),
    "tenant_hash": ((str,), True),
    "delegate_hash": ((str,), True),
    "model": ((str,), True),
}
_TYPE_NAMES = {str: "a string", int: "a whole number", dict: "an object", bool: "true or false"}


def log_files(path: Path) -> list[Path]:
    """``path`` preceded by its rotated predecessors that exist (``path.N`` ... ``path.1``), oldest first."""
    older = []
    index = 1
    while _rotated(path, index).is_file():
        older.append(_rotated(path, index))
        index += 1
    return [*reversed(older), path]


def read_records(path: Path, rotated: bool = True) -> Iterator[tuple[Path, int, dict[str, Any]]]:
    """Every record of the log at ``path`` (with its rotated predecessors unless ``rotated`` is false), oldest
    file first, as ``(file, line number from 1, record)``; blank lines and unknown ``event`` kinds are skipped.

    Raises:
        EventLogError: a missing or unreadable file, a line that is not a JSON object, a record of a later
            format version, a missing key or a value of the wrong type; the message names the file and line.
    """
    for file in log_files(path) if rotated else [path]:
        with open_regular(file, EventLogError, "a request log") as handle:
            number = 0
            try:
                for number, raw in enumerate(handle, start=1):
                    record = _parse(file, number, raw)
                    if record is not None:
                        yield file, number, record
            except OSError as exc:
                raise EventLogError(f"{file}:{number + 1}: cannot read: {exc.strerror or exc}") from None


def _parse(file: Path, number: int, raw: bytes) -> dict[str, Any] | None:
    where = f"{file}:{number}"
    if not raw.strip():
        return None
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise EventLogError(f"{where}: not UTF-8 text") from None
    except (json.JSONDecodeError, RecursionError, ValueError) as exc:
        text = raw.decode("utf-8", "replace").strip()
        preview = text if len(text) <= 60 else text[:57] + "..."
        raise EventLogError(f"{where}: not a JSON record ({getattr(exc, 'msg', exc)}): {preview}") from None
    if not isinstance(record, dict):
        raise EventLogError(f"{where}: not a JSON object")
    version = record.get("v")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise EventLogError(f"{where}: key 'v': expected the format version {SCHEMA_VERSION}")
    if version > SCHEMA_VERSION:
        raise EventLogError(
            f"{where}: format version {version} is newer than this fairgate reads ({SCHEMA_VERSION}); upgrade fairgate"
        )
    kind = record.get("event")
    if not isinstance(kind, str):
        raise EventLogError(f"{where}: key 'event': expected a string such as \"finished\"")
    if kind not in _FIELDS:
        return None
    _check(where, record, "ts", _NUMBER, False)
    if not math.isfinite(record["ts"]):
        raise EventLogError(f"{where}: key 'ts': expected seconds since the epoch")
    for key, (types, nullable) in (_REQUEST_KEYS if kind in REQUEST_EVENTS else {}).items():
        _check(where, record, key, types, nullable)
    if version == 1 and kind == "finished":
        _name_the_ttft(where, record)
    for key, (types, nullable) in _FIELDS[kind].items():
        _check(where, record, key, types, nullable)
    for key, (types, nullable) in _OPTIONAL.get(kind, {}).items():
        if key in record:
            _check(where, record, key, types, nullable)
    if kind == "usage":
        for tenant, value in record["gpu_ms"].items():
            if not isinstance(value, _NUMBER) or isinstance(value, bool):
                raise EventLogError(f"{where}: key 'gpu_ms.{tenant}': expected a number of GPU ms")
    return record


def _name_the_ttft(where: str, record: dict[str, Any]) -> None:
    """A version 1 ``finished`` record given the version 2 TTFT keys (module docstring), in place."""
    _check(where, record, "queue_ms", _NUMBER, False)
    _check(where, record, "ttft_ms", _NUMBER, True)
    after_dispatch = record["ttft_ms"]
    record["first_token_after_dispatch_ms"] = after_dispatch
    record["ttft_incl_queue_ms"] = None if after_dispatch is None else _ms(record["queue_ms"] + after_dispatch)


def _check(where: str, record: dict[str, Any], key: str, types: tuple[type, ...], nullable: bool) -> None:
    if key not in record:
        raise EventLogError(f"{where}: {record['event']} record: key {key!r} is missing")
    value = record[key]
    if value is None and nullable:
        return
    if isinstance(value, types) and (bool in types or not isinstance(value, bool)):
        return
    expected = "a number" if types == _NUMBER else _TYPE_NAMES.get(types[0], types[0].__name__)
    raise EventLogError(
        f"{where}: {record['event']} record: key {key!r}: expected {expected}"
        f"{' or null' if nullable else ''}, found {json.dumps(value)[:40]}"
    )


__all__ = [
    "BACKUPS",
    "FLUSH_EVERY_S",
    "MAX_BYTES",
    "SCHEMA_VERSION",
    "USAGE_EVERY_S",
    "EventLog",
    "EventLogError",
    "install",
    "iso_time",
    "log_files",
    "read_records",
]
