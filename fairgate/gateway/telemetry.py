"""OpenTelemetry traces: one per request, exported over OTLP/HTTP; off unless ``[telemetry]`` names a collector.

```toml
[telemetry]
otlp_traces_url = "http://127.0.0.1:4318/v1/traces"   # an OpenTelemetry collector's OTLP/HTTP traces endpoint
service_name = "fairgate"
headers = { "x-api-key" = "..." }                    # optional: sent with every export
```

Each request's trace is made when the request is over (``records``), from the instants its events carry: a
server span named as OpenTelemetry's GenAI conventions name an inference call (``chat MODEL``,
``text_completion MODEL``, ``embeddings MODEL``) from receipt to the end, and inside it ``intake`` (headers,
authentication, the body read and sized up), ``admission`` (the ledger reservation), ``queue`` (waiting for a
slot), ``upstream`` (the call, with a ``first_token`` event) and ``settlement`` (its final booking) - those
that happened. Attributes: ``gen_ai.operation.name``, ``gen_ai.request.model``, ``gen_ai.usage.input_tokens``
and ``gen_ai.usage.output_tokens`` (billed), ``gen_ai.request.max_tokens``, HTTP method, route and status, and
``fairgate.*``: the tenant's hash (never its name), request id, outcome, rejection reason, upstream, queue
ms, GPU ms billed. A request that came with a W3C ``traceparent`` header (and ``tracestate``) is traced as
a child of that caller's span, in the caller's trace (read by OpenTelemetry's propagator; a malformed header
is ignored and the request gets a trace of its own; a caller's "not sampled" flag is obeyed: nothing is
exported). The trace id (32 hex digits) is the access log's ``trace_id``, so a slow request's line leads to
its trace. The SDK's batch processor exports from its own thread; the rest is flushed at shutdown.
Needs the ``otel`` extra (``pip install 'fairgate[otel]'``): the config says so when it is missing.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fairgate.gateway.config import TelemetryConfig
from fairgate.gateway.records import RequestRecord
from fairgate.ledger.base import tenant_tag

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Tracer

EXPORT_TIMEOUT_S = 2.0
OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion", "/v1/embeddings": "embeddings"}


def _ns(time_s: float) -> int:
    return int(time_s * 1e9)


@dataclass
class Tracing:
    """The tracer of one gateway app and the provider that exports its spans."""

    provider: TracerProvider
    tracer: Tracer

    def report(self, record: RequestRecord) -> None:
        """The trace of one request that is over (see module docstring); sets ``record.trace_id``."""
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        operation = OPERATIONS.get(record.path, "request")
        root = self.tracer.start_span(
            f"{operation} {record.model}" if record.model else operation,
            context=TraceContextTextMapPropagator().extract(record.trace_context),
            kind=trace.SpanKind.SERVER,
            start_time=_ns(record.received_s),
            attributes=_attributes(record, operation),
        )
        record.trace_id = trace.format_trace_id(root.get_span_context().trace_id)
        if (record.status or 0) >= 500 or record.outcome == "error":
            root.set_status(trace.Status(trace.StatusCode.ERROR, record.reason or record.outcome))
        inside = trace.set_span_in_context(root)
        for name, start_s, end_s in _phases(record):
            span = self.tracer.start_span(name, context=inside, start_time=_ns(start_s))
            if name == "upstream" and record.first_token_s is not None:
                span.add_event("first_token", timestamp=_ns(record.first_token_s))
            span.end(end_time=_ns(end_s))
        root.end(end_time=_ns(record.end_s))

    def shutdown(self) -> None:
        """Export what is left, then stop (the gateway's shutdown)."""
        self.provider.shutdown()


def _phases(record: RequestRecord) -> list[tuple[str, float, float]]:
    """(name, start, end) of each phase the request went through, in order; each ends where the next starts
    (a phase cut short by a refusal ends at the answer)."""
    f = record.finished
    marks = [
        ("intake", record.received_s),
        ("admission", record.admission_s),
        ("queue", record.admitted_s),
        ("upstream", record.dispatched_s),
        ("settlement", f.time_s if f is not None else None),
    ]
    reached = [(name, start) for name, start in marks if start is not None]
    ends = [start for _, start in reached[1:]] + [record.settled_s if f is not None else record.end_s]
    return [(name, start, max(start, end or start)) for (name, start), end in zip(reached, ends, strict=True)]


def _attributes(record: RequestRecord, operation: str) -> dict[str, Any]:
    f = record.finished
    attributes: dict[str, Any] = {
        "http.request.method": "POST",
        "http.route": record.path,
        "http.response.status_code": record.status or 0,
        "gen_ai.operation.name": operation,
        "fairgate.outcome": record.outcome,
    }
    optional = {
        "gen_ai.request.model": record.model,
        "fairgate.request_id": record.request_id,
        "fairgate.tenant_hash": tenant_tag(record.tenant) if record.tenant is not None else None,
        "fairgate.reason": record.reason,
        "fairgate.upstream": record.upstream,
        "fairgate.queue_ms": record.queue_ms,
    }
    if f is not None:
        optional |= {
            "gen_ai.usage.input_tokens": f.input_tokens,
            "gen_ai.usage.output_tokens": f.output_tokens,
            "gen_ai.request.max_tokens": f.max_output_tokens,
            "fairgate.gpu_ms": f.gpu_ms,
        }
    return attributes | {key: value for key, value in optional.items() if value is not None}


def resource_attributes(config: TelemetryConfig) -> dict[str, str | int]:
    """The trace resource: ``service.name`` as configured, and which process sent it (the gateway's
    processes share that name, and a trace must lead to the pod or host that served the request)."""
    host, pid = socket.gethostname(), os.getpid()
    return {
        "service.name": config.service_name,
        "service.instance.id": f"{host}:{pid}",
        "host.name": host,
        "process.pid": pid,
    }


def open_tracing(config: TelemetryConfig) -> Tracing | None:
    """The tracing of ``[telemetry]`` (None: off)."""
    if config.otlp_traces_url is None:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # A provider of its own, not the process's global one: several gateway apps may share a process (tests).
    provider = TracerProvider(resource=Resource.create(resource_attributes(config)))
    # A collector that hangs costs at most this per export (the SDK's default, 10 s, held a stop for 11 s).
    exporter = OTLPSpanExporter(endpoint=config.otlp_traces_url, headers=dict(config.headers), timeout=EXPORT_TIMEOUT_S)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return Tracing(provider, provider.get_tracer("fairgate.gateway"))


__all__ = ["OPERATIONS", "Tracing", "open_tracing", "resource_attributes"]
