"""OpenTelemetry traces (``fairgate.gateway.telemetry``): the gateway exports over real OTLP/HTTP to a
collector on loopback (a plain HTTP server here, decoding the protobuf with OpenTelemetry's own messages).
Each request is one trace whose spans and attributes say what happened, checked against what the client
received and what the ledger billed."""

from __future__ import annotations

import itertools
import json
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from fairgate.emulator.api import create_app
from fairgate.gateway.app import create_gateway
from fairgate.gateway.config import GatewayConfigError, load_gateway_config
from fairgate.harness.threads import serve_in_thread
from fairgate.ledger.base import tenant_tag
from tests.gateway.conftest import EMULATOR, ledger_call, write_config


@contextmanager
def collector(resources: list[dict[str, Any]] | None = None) -> Iterator[tuple[str, list[Any]]]:
    """An OTLP/HTTP traces endpoint on loopback: its URL and the spans it received (decoded); each export's
    resource attributes go to ``resources`` when given."""
    spans: list[Any] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            request = ExportTraceServiceRequest.FromString(body)
            for resource in request.resource_spans:
                service = {a.key: a.value.string_value for a in resource.resource.attributes}["service.name"]
                if resources is not None:
                    resources.append(attributes(resource.resource))
                spans.extend((service, span) for scope in resource.scope_spans for span in scope.spans)
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/v1/traces", spans
    finally:
        server.shutdown()
        server.server_close()


def attributes(span: Any) -> dict[str, Any]:
    out = {}
    for a in span.attributes:
        value = a.value
        out[a.key] = getattr(value, value.WhichOneof("value"))
    return out


def test_each_request_is_one_trace_with_its_phases_and_billed_usage(tmp_path: Path) -> None:
    with collector() as (url, spans), serve_in_thread(create_app(EMULATOR)) as emulator:
        path, keys = write_config(tmp_path, [emulator])
        path.write_text(path.read_text() + f'\n[telemetry]\notlp_traces_url = "{url}"\nservice_name = "fg-test"\n')
        config = load_gateway_config(path)
        headers = {"Authorization": f"Bearer {keys['alpha']}", "X-Request-Id": "traced-1"}
        body = {"model": "emu", "messages": [{"role": "user", "content": "a b c"}], "max_tokens": 5, "ignore_eos": True}
        with serve_in_thread(create_gateway(config)) as gateway:
            served = httpx.post(f"{gateway}/v1/chat/completions", json=body, headers=headers, timeout=30)
            refused = httpx.post(
                f"{gateway}/v1/chat/completions",
                json={**body, "model": "nope"},
                headers=headers | {"X-Request-Id": "t-2"},
            )
        [reservation] = ledger_call(config, lambda ledger: ledger.reservations("alpha"))
    assert served.status_code == 200 and refused.status_code == 404
    assert {service for service, _ in spans} == {"fg-test"}
    by_trace: dict[bytes, list[Any]] = {}
    for _, span in spans:
        by_trace.setdefault(span.trace_id, []).append(span)
    assert len(by_trace) == 2  # one trace per request
    [ok] = [t for t in by_trace.values() if any(attributes(s).get("fairgate.request_id") == "traced-1" for s in t)]
    [root] = [s for s in ok if not s.parent_span_id]
    assert root.name == "chat emu"
    phases = sorted((s for s in ok if s.parent_span_id), key=lambda s: s.start_time_unix_nano)
    assert [s.name for s in phases] == ["intake", "admission", "queue", "upstream", "settlement"]
    assert all(s.parent_span_id == root.span_id for s in phases)
    assert (
        root.start_time_unix_nano == phases[0].start_time_unix_nano
        and root.end_time_unix_nano >= phases[-1].end_time_unix_nano
    )
    assert all(a.end_time_unix_nano <= b.start_time_unix_nano + 1 for a, b in itertools.pairwise(phases))
    assert [e.name for e in phases[3].events] == ["first_token"]
    attrs = attributes(root)
    billed = reservation.billed
    usage = served.json()["usage"]
    assert attrs["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == billed.output_tokens == 5
    assert attrs["gen_ai.usage.input_tokens"] == billed.input_tokens
    assert attrs["fairgate.gpu_ms"] == pytest.approx(billed.gpu_ms)
    assert (attrs["gen_ai.operation.name"], attrs["gen_ai.request.model"], attrs["http.response.status_code"]) == (
        "chat",
        "emu",
        200,
    )
    assert attrs["fairgate.tenant_hash"] == tenant_tag("alpha") and "alpha" not in str(spans)
    [no] = [t for t in by_trace.values() if t is not ok]
    [refused_root] = [s for s in no if not s.parent_span_id]
    refused_attrs = attributes(refused_root)
    assert (refused_attrs["http.response.status_code"], refused_attrs["fairgate.outcome"]) == (404, "rejected")
    assert [s.name for s in no if s.parent_span_id] == ["intake"]  # refused before the ledger


def test_telemetry_config_errors_are_one_line(tmp_path: Path) -> None:
    path, _ = write_config(tmp_path, ["http://127.0.0.1:9"])
    base = path.read_text()
    for table, needle in [
        ('[telemetry]\notlp_traces_url = "grpc://x:4317"\n', "telemetry.otlp_traces_url"),
        ('[telemetry]\notlp_traces_url = "http://:99999/v1/traces"\n', "telemetry.otlp_traces_url"),
        ('[telemetry]\notlp_traces_url = "http://127.0.0.1:4318"\n', "give the traces path too"),
        (
            '[telemetry]\notlp_traces_url = "http://x:4318/v1/traces"\nheaders = { k = "v\\r\\nX: 1" }\n',
            "control characters",
        ),
        ('[telemetry]\nservice_name = ""\n', "telemetry.service_name"),
        ('[telemetry]\nendpoint = "http://x"\n', "telemetry.endpoint"),
    ]:
        path.write_text(base + "\n" + table)
        with pytest.raises(GatewayConfigError) as error:
            load_gateway_config(path)
        assert needle in str(error.value) and "\n" not in str(error.value)


def test_the_access_log_names_each_requests_trace_and_a_callers_traceparent_is_its_parent(tmp_path: Path) -> None:
    caller_trace, caller_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with collector() as (url, spans), serve_in_thread(create_app(EMULATOR)) as emulator:
        path, keys = write_config(tmp_path, [emulator], gateway_table={"access_log": "access.jsonl"})
        path.write_text(path.read_text() + f'\n[telemetry]\notlp_traces_url = "{url}"\n')
        body = {"model": "emu", "prompt": "a b", "max_tokens": 3, "ignore_eos": True}
        with serve_in_thread(create_gateway(load_gateway_config(path))) as gateway:
            for request_id, extra in [
                ("own-trace", {}),
                ("in-caller-trace", {"traceparent": f"00-{caller_trace}-{caller_span}-01", "tracestate": "k=v"}),
                ("bad-traceparent", {"traceparent": "00-not-a-trace-01"}),
            ]:
                headers = {"Authorization": f"Bearer {keys['alpha']}", "X-Request-Id": request_id, **extra}
                reply = httpx.post(f"{gateway}/v1/completions", json=body, headers=headers, timeout=30)
                assert reply.status_code == 200
    lines = {line["request_id"]: line for line in map(json.loads, (tmp_path / "access.jsonl").read_text().splitlines())}
    roots = {attributes(s)["fairgate.request_id"]: s for _, s in spans if attributes(s).get("fairgate.request_id")}
    assert set(lines) == set(roots) == {"own-trace", "in-caller-trace", "bad-traceparent"}
    for request_id, line in lines.items():
        assert re.fullmatch(r"[0-9a-f]{32}", line["trace_id"]), line
        assert line["trace_id"] == roots[request_id].trace_id.hex()  # the line leads to the exported trace
    assert lines["in-caller-trace"]["trace_id"] == caller_trace
    assert roots["in-caller-trace"].parent_span_id.hex() == caller_span
    assert not roots["own-trace"].parent_span_id and not roots["bad-traceparent"].parent_span_id
    assert len({line["trace_id"] for line in lines.values()}) == 3


def test_serve_names_the_collector_at_start_and_each_process_is_told_apart_in_its_traces(tmp_path: Path) -> None:
    """Found by a new user: nothing said tracing was on. ``fairgate serve`` prints where traces go (no
    credentials, query or headers), and the resource names the host and process beside ``service.name``."""
    from fairgate.harness.process import free_port

    resources: list[dict[str, Any]] = []
    with collector(resources) as (url, spans), serve_in_thread(create_app(EMULATOR)) as emulator:
        path, keys = write_config(tmp_path, [emulator])
        secret_url = url.replace("http://", "http://user:pw-secret@") + "?token=q-secret"
        telemetry = f'\n[telemetry]\notlp_traces_url = "{secret_url}"\nheaders = {{ "x-api-key" = "h-secret" }}\n'
        path.write_text(path.read_text() + telemetry)
        port = free_port()
        command = [sys.executable, "-m", "fairgate", "serve", "--config", str(path), "--port", str(port)]
        process = subprocess.Popen(
            [*command, "--duration", "20"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            for _ in range(300):
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health/live", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
            body = {"model": "emu", "prompt": "a b", "max_tokens": 3, "ignore_eos": True}
            headers = {"Authorization": f"Bearer {keys['alpha']}"}
            reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, headers=headers, timeout=30)
            process.send_signal(2)  # SIGINT: a graceful stop flushes the traces
            out, err = process.communicate(timeout=60)
        finally:
            process.kill()
    assert reply.status_code == 200
    lines = [line for line in out.splitlines() if line.startswith("tracing:")]
    assert lines == [f"tracing: OTLP/HTTP traces to {url} (service.name 'fairgate')"], out + err
    assert "secret" not in out + err
    assert len(spans) >= 2 and resources
    for resource in resources:
        assert resource["service.name"] == "fairgate" and resource["process.pid"] == process.pid
        assert resource["host.name"] == socket.gethostname()
        assert resource["service.instance.id"] == f"{socket.gethostname()}:{process.pid}"
