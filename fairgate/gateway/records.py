"""One record per HTTP request, filled from the request path's events and handed, once the request is over,
to the sinks that report it: the access log (``accesslog``) and the traces (``telemetry``).

A request's events are matched to its HTTP request, not to its request id (a re-sent id answered 409 is a
record of its own): ``RecordedRoute`` opens a record in a context variable, which the admission, dispatch
and call stages (and the settlement task they start) run under. A request is over when it was answered and,
if it got an upstream call, that call's final settlement was booked (``Settled``).
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from fairgate.gateway.observe import Admitted, Charged, Dispatched, Event, Finished, Rejected, Settled

log = logging.getLogger("fairgate.gateway")


@dataclass
class RequestRecord:
    """One HTTP request: what and when (wall-clock seconds), filled by its events; ``None``: did not happen."""

    path: str
    received_s: float
    request_id: str | None = None
    tenant: str | None = None
    key_id: str | None = None  # the key it came with, once authenticated (``identity.Caller.key_id``)
    model: str | None = None
    status: int | None = None  # as answered (a stream: at its start)
    reason: str | None = None  # of a rejection (``observe.REJECT_REASONS``)
    code: str | None = None
    admission_s: float | None = None  # the body was read and sized up; the ledger reservation starts
    admitted_s: float | None = None
    dispatched_s: float | None = None
    queue_ms: float | None = None
    upstream: str | None = None
    finished: Finished | None = None
    settled_s: float | None = None
    answered_s: float | None = None
    trace_context: dict[str, str] = field(default_factory=dict)  # the W3C trace headers it came with
    trace_id: str | None = None  # its OpenTelemetry trace (32 hex digits), once traced (``telemetry``)
    reported: bool = False

    @property
    def over(self) -> bool:
        """Answered, and its upstream call (if it got one) settled."""
        return self.status is not None and (self.dispatched_s is None or self.settled_s is not None)

    @property
    def end_s(self) -> float:
        """When nothing more happened to it: the answer, or the settlement after it."""
        return max(self.received_s, self.answered_s or 0.0, self.settled_s or 0.0)

    @property
    def outcome(self) -> str:
        """``completed``, ``cancelled`` (the client left), ``error`` (the upstream failed) or ``rejected``."""
        if self.finished is not None:
            return self.finished.outcome
        if self.status == 499:  # the client left before it was answered (queued, or its body unread)
            return "cancelled"
        if (self.status or 0) >= 500 and self.reason is None:  # failed on the platform's side, not refused
            return "error"
        return "completed" if self.status == 200 else "rejected"

    @property
    def first_token_s(self) -> float | None:
        """When the first output token came (wall-clock seconds); None: no token."""
        f = self.finished
        return (
            None if f is None or f.ttft_ms is None or self.dispatched_s is None else self.dispatched_s + f.ttft_ms / 1e3
        )

    @property
    def ttft_incl_queue_ms(self) -> float | None:
        """Time to first token from admission (joining its tenant's queue), the queue included, in ms: the
        one TTFT of ``/metrics``, the dashboard, the event log and ``fairgate report``. None: no token."""
        f = self.finished
        return None if f is None or f.ttft_ms is None else f.queue_ms + f.ttft_ms


Sink = Callable[[RequestRecord], None]
_current: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar("fairgate_request", default=None)


TRACE_HEADERS = ("traceparent", "tracestate")  # W3C Trace Context: the caller's trace, read by ``telemetry``


def open_record(path: str, received_s: float, headers: Mapping[str, str] | None = None) -> RequestRecord:
    """Start the record of the HTTP request being served (in this task's context and the tasks it starts),
    received at ``received_s`` (wall-clock seconds) with ``headers`` (only the W3C trace headers are kept)."""
    record = RequestRecord(path, received_s)
    if headers is not None:
        record.trace_context = {name: value for name in TRACE_HEADERS if (value := headers.get(name)) is not None}
    _current.set(record)
    return record


def note_admission(time_s: float) -> None:
    """The request being served starts its ledger reservation now (intake is over)."""
    record = _current.get()
    if record is not None:
        record.admission_s = time_s


def note_requeued() -> None:
    """The request being served goes back to its queue: the upstream it was dispatched to refused the connection
    (``completions._run``). Its record is as before that dispatch, so that it is over when answered, and a later
    dispatch is the one it reports."""
    record = _current.get()
    if record is not None:
        record.dispatched_s = record.queue_ms = record.upstream = None


class RequestRecorder:
    """The observer that fills the current request's record and hands it to ``sinks`` when it is over."""

    def __init__(self, sinks: Sequence[Sink]) -> None:
        self.sinks = list(sinks)

    def observe(self, event: Event) -> None:
        if type(event) is Charged:  # the hot path (once per token or read): nothing a report needs
            return
        record = _current.get()
        if record is None or record.reported:
            return  # not a request's event (the meter's charges, a background sweep), or after its report
        if isinstance(event, Settled):
            record.settled_s = event.time_s
            self._report_if_over(record)
        elif isinstance(event, Finished):
            record.finished = event
        elif isinstance(event, Dispatched):
            record.dispatched_s, record.queue_ms, record.upstream = event.time_s, event.queue_ms, event.upstream
        elif isinstance(event, Admitted | Rejected):
            record.tenant = event.tenant or record.tenant
            record.model = event.model or record.model
            if isinstance(event, Admitted):
                record.admitted_s, record.key_id = event.time_s, event.key_id
            else:
                record.reason, record.code = event.reason, event.code
                record.key_id = record.key_id or event.key_id

    def answered(self, record: RequestRecord, request_id: str | None, status: int, time_s: float) -> None:
        """The gateway answered ``record``'s request with ``status`` (a stream: its start)."""
        record.request_id, record.status, record.answered_s = request_id, status, time_s
        self._report_if_over(record)

    def _report_if_over(self, record: RequestRecord) -> None:
        if not record.over or record.reported:
            return
        record.reported = True
        for sink in self.sinks:
            try:
                sink(record)
            except Exception:  # a report must never fail the request path
                log.exception("request report failed: %r", sink)


__all__ = [
    "TRACE_HEADERS",
    "RequestRecord",
    "RequestRecorder",
    "Sink",
    "note_admission",
    "note_requeued",
    "open_record",
]
