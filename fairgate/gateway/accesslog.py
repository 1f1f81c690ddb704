"""The access log: one JSON line per request the gateway answered, to stderr by default.

``[gateway].access_log``: ``"-"`` (the default) writes to stderr, a path to that file (appended; relative to
the config's folder), ``""`` turns it off. The line is written when the request is over: for a stream, when
its final settlement was booked; for anything else, when its answer was sent. Keys:

- ``ts`` (seconds since the epoch) and ``time`` (ISO 8601 UTC, ms): when the gateway received the request;
- ``request_id``; ``tenant_hash`` (``tenant_tag``; ``null``: no credential identified it; a raw tenant name is
  never written); ``model`` (as the client asked; ``null`` if unread); ``path``;
- ``status``: the HTTP status answered (a stream's is 200, even when its upstream failed mid-way: ``outcome``
  says so); ``outcome``: ``completed``, ``cancelled`` (the client left), ``error`` (the upstream failed) or
  ``rejected`` (answered with an error before running: ``reason`` and ``code`` say why, as in
  ``fairgate.gateway.observe.REJECT_REASONS`` and the OpenAI error body);
- ``upstream``; ``queue_ms`` (admission to dispatch); ``ttft_ms``: time to first token as the client waits
  for it, from receipt (authentication, admission and queue included) to the first token; ``latency_ms``:
  from receipt to the end;
- ``input_tokens``, ``output_tokens``, ``gpu_ms``: what was billed (0 for a rejection).

A request's events are matched to its HTTP request, not to its request id (a re-sent id answered 409 is a
line of its own): ``RecordedRoute`` opens a record in a context variable, which the admission, dispatch and
call stages (and the settlement task they start) run under. Lines go through a ``logging.handlers`` queue to
a listener thread, so the event loop never waits for the terminal or the disk.
"""

from __future__ import annotations

import contextvars
import logging
import logging.handlers
import queue
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import FastAPI

from fairgate.gateway.config import ACCESS_LOG_STDERR as STDERR
from fairgate.gateway.observe import Admitted, Dispatched, Event, Finished, Rejected
from fairgate.ledger.base import tenant_tag

if TYPE_CHECKING:
    from fairgate.gateway.state import GatewayState

LOGGER = "fairgate.access"


@dataclass
class AccessRecord:
    """One HTTP request as the access log sees it: filled by its events, written once when it is over."""

    path: str
    received_s: float  # wall clock
    request_id: str | None = None
    tenant: str | None = None
    model: str | None = None
    status: int | None = None
    reason: str | None = None
    code: str | None = None
    dispatched_s: float | None = None
    finished: Finished | None = None
    queue_ms: float | None = None
    upstream: str | None = None
    end_s: float | None = None
    written: bool = False

    @property
    def over(self) -> bool:
        """Answered, and its upstream call (if it got one) settled."""
        return self.status is not None and (self.dispatched_s is None or self.finished is not None)

    def line(self) -> bytes:
        """The JSON line (see module docstring), without its newline."""
        f = self.finished
        ttft_ms = None
        if f is not None and f.ttft_ms is not None and self.dispatched_s is not None:
            ttft_ms = round((self.dispatched_s - self.received_s) * 1000.0 + f.ttft_ms, 3)
        end_s = max(self.end_s or self.received_s, f.time_s if f else self.received_s)
        outcome = f.outcome if f is not None else "rejected" if self.status != 200 else "completed"
        ts = round(self.received_s, 3)
        return orjson.dumps(
            {
                "ts": ts,
                "time": datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds")[:-6] + "Z",
                "request_id": self.request_id,
                "tenant_hash": tenant_tag(self.tenant) if self.tenant is not None else None,
                "model": self.model,
                "path": self.path,
                "status": self.status,
                "outcome": outcome,
                "reason": self.reason,
                "code": self.code,
                "upstream": self.upstream,
                "queue_ms": None if self.queue_ms is None else round(self.queue_ms, 3),
                "ttft_ms": ttft_ms,
                "latency_ms": round((end_s - self.received_s) * 1000.0, 3),
                "input_tokens": f.input_tokens if f else 0,
                "output_tokens": f.output_tokens if f else 0,
                "gpu_ms": round(f.gpu_ms, 3) if f else 0.0,
            }
        )


_current: contextvars.ContextVar[AccessRecord | None] = contextvars.ContextVar("fairgate_access", default=None)


def open_record(path: str, received_s: float) -> AccessRecord:
    """Start the record of the HTTP request being served (in this task's context and the tasks it starts)."""
    record = AccessRecord(path, received_s)
    _current.set(record)
    return record


class AccessLog:
    """The observer that fills the current request's record and writes it when it is over (``answered``)."""

    def __init__(self, lines: logging.handlers.QueueHandler) -> None:
        self._lines = lines

    def observe(self, event: Event) -> None:
        record = _current.get()
        if record is None or record.written:
            return  # not a request's event (the meter's charges, a background sweep), or after its line
        if isinstance(event, Finished):
            record.finished = event
            if record.over:
                self._write(record)
            return
        if isinstance(event, Admitted | Rejected):
            record.tenant = event.tenant or record.tenant
            record.model = event.model or record.model
            if isinstance(event, Rejected):
                record.reason, record.code = event.reason, event.code
        elif isinstance(event, Dispatched):
            record.dispatched_s, record.queue_ms, record.upstream = event.time_s, event.queue_ms, event.upstream

    def answered(self, record: AccessRecord, request_id: str | None, status: int, time_s: float) -> None:
        """The gateway answered ``record``'s request with ``status`` (a stream: its start)."""
        record.request_id, record.status, record.end_s = request_id, status, time_s
        if record.over and not record.written:
            self._write(record)

    def _write(self, record: AccessRecord) -> None:
        record.written = True
        self._lines.handle(logging.makeLogRecord({"name": LOGGER, "msg": record.line().decode()}))


def install(app: FastAPI, state: GatewayState) -> None:
    """Add the access log of ``[gateway].access_log`` to the gateway ``app`` (nothing when it is off): its
    observer on the request path's events and, around the app's lifespan, its writer thread (stopped, the
    lines written, after the app's own clean-up)."""
    opened = open_access_log(state.config.gateway.access_log)
    if opened is None:
        return
    access_log, listener = opened
    state.access_log = access_log
    state.events.add(access_log)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(running: Any) -> AsyncIterator[Any]:
        listener.start()
        try:
            async with inner(running) as inner_state:
                yield inner_state
        finally:
            listener.stop()  # after every line queued is written
            for handler in listener.handlers:
                handler.close()

    app.router.lifespan_context = lifespan


def open_access_log(target: str | None) -> tuple[AccessLog, logging.handlers.QueueListener] | None:
    """The access log writing to ``target`` (``"-"``: stderr; a path; ``""`` or None: off), and the listener
    thread to start and stop with the gateway. Raises ``OSError``: the file cannot be opened for appending."""
    if not target:
        return None
    handler: logging.Handler
    if target == STDERR:
        handler = logging.StreamHandler(sys.stderr)
    else:
        handler = logging.handlers.WatchedFileHandler(Path(target), encoding="utf-8")  # follows logrotate
    handler.setFormatter(logging.Formatter("%(message)s"))
    lines: queue.SimpleQueue[Any] = queue.SimpleQueue()
    return AccessLog(logging.handlers.QueueHandler(lines)), logging.handlers.QueueListener(lines, handler)


__all__ = ["STDERR", "AccessLog", "AccessRecord", "install", "open_access_log", "open_record"]
