"""The access log: one JSON line per request to the generation routes (``/v1/chat/completions``,
``/v1/completions``, ``/v1/embeddings``), to stderr by default. (Requests refused by the connection bounds
before they reach a route - 431, a head's 408, 503 - and the other routes are not in it. A body not complete
within ``body_timeout_s`` is answered 408 by the server, ``fairgate.gateway.serving``, and its line says 499
``cancelled``: the route, reading the body, saw its client leave.)

``[gateway].access_log``: ``"-"`` (the default) writes to stderr, a path to that file (appended; relative to
the config's folder), ``""`` turns it off. The line is written when the request is over (``records``): for a
call that ran, once its final settlement was booked; for anything else, when its answer was sent. Keys:

- ``ts`` (seconds since the epoch) and ``time`` (ISO 8601 UTC, ms): when the gateway received the request;
- ``request_id``; ``tenant_hash`` (``tenant_tag``; ``null``: no credential identified it; a raw tenant name is
  never written); ``key_id``: the key it came with, its stored hash's first 19 characters (as in ``fairgate
  keys list``; ``null``: not admitted); ``model`` (as the client asked; ``null`` if unread); ``path``;
- ``status``: the HTTP status answered (a stream's is 200, even when its upstream failed mid-way: ``outcome``
  says so); ``outcome``: ``completed``, ``cancelled`` (the client left, queued or running; 499 when nothing
  was sent), ``error`` (the upstream failed) or
  ``rejected`` (answered with an error before running: ``reason`` and ``code`` say why, as in
  ``fairgate.gateway.observe.REJECT_REASONS`` and the OpenAI error body);
- ``upstream``; ``queue_ms`` (admission to dispatch); ``ttft_incl_queue_ms``: time to first token from
  admission (the request joining its tenant's queue) to the first token, the queue included - the TTFT of
  ``/metrics``, the dashboard, the event log and ``fairgate report`` (``null``: no token); ``latency_ms``:
  from receipt to the end (authentication and the final settlement included);
- ``input_tokens``, ``output_tokens``, ``gpu_ms``: what was billed (0 for a rejection);
- ``trace_id``: the request's OpenTelemetry trace id, 32 hex digits, when ``[telemetry]`` is on (the caller's
  trace when it sent a W3C ``traceparent``: ``fairgate.gateway.telemetry``); else ``null``.

Requests' records go through a queue to a listener thread (``logging.handlers.QueueListener``), which makes
and writes their lines within 0.05 s: the event loop never waits for the terminal or the disk.
"""

from __future__ import annotations

import logging
import logging.handlers
import queue
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import FastAPI

from fairgate.gateway import telemetry
from fairgate.gateway.config import ACCESS_LOG_STDERR as STDERR
from fairgate.gateway.records import RequestRecord, RequestRecorder, Sink
from fairgate.ledger.base import tenant_tag

if TYPE_CHECKING:
    from fairgate.gateway.state import GatewayState

LOGGER = "fairgate.access"


def line_of(record: RequestRecord) -> bytes:
    """The access log's JSON line of ``record`` (see module docstring), without its newline."""
    f = record.finished
    # Summed as the event log writes it (its two parts rounded to 1 µs first), so the two logs agree to the µs.
    ttft_ms = None if f is None or f.ttft_ms is None else round(f.queue_ms, 3) + round(f.ttft_ms, 3)
    ts = round(record.received_s, 3)
    return orjson.dumps(
        {
            "ts": ts,
            "time": datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds")[:-6] + "Z",
            "request_id": record.request_id,
            "tenant_hash": tenant_tag(record.tenant) if record.tenant is not None else None,
            "key_id": record.key_id,
            "model": record.model,
            "path": record.path,
            "status": record.status,
            "outcome": record.outcome,
            "reason": record.reason,
            "code": record.code,
            "upstream": record.upstream,
            "queue_ms": None if record.queue_ms is None else round(record.queue_ms, 3),
            "ttft_incl_queue_ms": None if ttft_ms is None else round(ttft_ms, 3),
            "latency_ms": round((record.end_s - record.received_s) * 1000.0, 3),
            "input_tokens": f.input_tokens if f else 0,
            "output_tokens": f.output_tokens if f else 0,
            "gpu_ms": round(f.gpu_ms, 3) if f else 0.0,
            "trace_id": record.trace_id,
        }
    )


def open_access_log(target: str | None) -> tuple[Sink, logging.handlers.QueueListener] | None:
    """The access log's sink writing to ``target`` (``"-"``: stderr; a path; ``""`` or None: off), and the
    listener thread to start and stop with the gateway. Raises ``OSError``: the file cannot be opened."""
    if not target:
        return None
    handler: logging.Handler
    if target == STDERR:
        handler = _Quiet(logging.StreamHandler(sys.stderr))
    else:
        handler = _Quiet(logging.handlers.WatchedFileHandler(Path(target), encoding="utf-8"))  # follows logrotate
    handler.setFormatter(logging.Formatter("%(message)s"))
    records = _Polled()
    return records.put, _LineWriter(records, handler)


class _Polled:
    """The queue between the event loop and the access log's thread: a put never wakes the thread, which looks
    for records every ``POLL_S`` seconds. A blocking queue woke it at every request: the put was 1-2 % of the
    gateway's CPU per request (py-spy), and the thread then took the GIL from the loop each time."""

    POLL_S = 0.05

    def __init__(self) -> None:
        self._items: deque[Any] = deque()  # appends and pops of a deque are atomic

    def put(self, item: Any) -> None:
        self._items.append(item)

    put_nowait = put

    def get(self, block: bool = True) -> Any:
        """The oldest item; waits for one when ``block``. Raises ``queue.Empty`` (none, not ``block``)."""
        while True:
            try:
                return self._items.popleft()
            except IndexError:
                if not block:
                    raise queue.Empty from None
            time.sleep(self.POLL_S)


class _LineWriter(logging.handlers.QueueListener):
    """The listener thread of the access log: it takes the reported ``RequestRecord`` itself (nothing changes
    it once reported) and makes its line and log record there. A ``QueueHandler`` on the event loop made the
    log record, formatted and copied it there: 2 % of the gateway's CPU per request (py-spy), and the line's
    own making 1.3 % more, on every answer's path."""

    def prepare(self, record: Any) -> logging.LogRecord:
        return logging.makeLogRecord({"name": LOGGER, "msg": line_of(record).decode()})

    def handle(self, record: Any) -> None:
        try:
            super().handle(record)
        except Exception:  # one bad record must not end the thread (every later line would be lost)
            logging.getLogger("fairgate.gateway").exception("access log line failed: %r", record)


class _Quiet(logging.Handler):
    """``inner``, whose write errors (a full disk, a closed stderr) are reported once, as one warning line,
    not as a traceback per line; lines are dropped while it cannot write."""

    def __init__(self, inner: logging.Handler) -> None:
        super().__init__()
        self.inner, self.failed = inner, False
        inner.handleError = self._failed  # type: ignore[method-assign]

    def emit(self, record: logging.LogRecord) -> None:
        self.inner.emit(record)

    def setFormatter(self, fmt: logging.Formatter | None) -> None:
        self.inner.setFormatter(fmt)

    def close(self) -> None:
        self.inner.close()
        super().close()

    def _failed(self, record: logging.LogRecord) -> None:
        if not self.failed:
            self.failed = True
            error = sys.exc_info()[1]
            logging.getLogger("fairgate.gateway").warning(
                orjson.dumps({"event": "access_log_failed", "error": str(error)}).decode()
            )


def install(app: FastAPI, state: GatewayState) -> None:
    """Report every request on the gateway ``app``: the access log (``[gateway].access_log``) and the traces
    (``[telemetry]``), whichever are on; nothing when both are off. Around the app's lifespan their writers
    start, and stop - every report written or exported - after the app's own clean-up."""
    sinks: list[Sink] = []
    starts: list[Callable[[], None]] = []
    stops: list[Callable[[], None]] = []
    tracing = telemetry.open_tracing(state.config.telemetry)
    if tracing is not None:
        sinks.append(tracing.report)  # first: it gives the record the trace id the access log line names
        stops.append(tracing.shutdown)
    opened = open_access_log(state.config.gateway.access_log)
    if opened is not None:
        sink, listener = opened
        sinks.append(sink)
        starts.append(listener.start)
        stops.append(lambda: _stop(listener))
    if not sinks:
        return
    state.request_records = RequestRecorder(sinks)
    state.events.add(state.request_records)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(running: Any) -> AsyncIterator[Any]:
        for start in starts:
            start()
        try:
            async with inner(running) as inner_state:
                yield inner_state
        finally:
            for stop in stops:
                stop()

    app.router.lifespan_context = lifespan


def _stop(listener: logging.handlers.QueueListener) -> None:
    listener.stop()  # after every line queued is written
    for handler in listener.handlers:
        handler.close()


__all__ = ["STDERR", "install", "line_of", "open_access_log"]
