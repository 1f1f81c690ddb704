"""The access log (``fairgate.gateway.accesslog``): one JSON line per request answered, over real HTTP, each
line checked against what the client received and what the ledger billed its reservation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from fairgate.harness.process import free_port
from fairgate.ledger import Reservation
from fairgate.ledger.base import tenant_tag
from tests.conftest import fairgate, streamed_chat
from tests.gateway.conftest import Stack, serve_stack, write_config

BODY = {"model": "emu", "prompt": "a b c", "max_tokens": 6, "ignore_eos": True}


def lines_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def post(stack: Stack, request_id: str, tenant: str = "alpha", key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key or stack.keys[tenant]}", "X-Request-Id": request_id}
    return httpx.post(f"{stack.url}/v1/completions", json=BODY, headers=headers, timeout=30)


def by_id(reservations: list[Reservation]) -> dict[str, Reservation]:
    return {r.request_id: r for r in reservations}


def test_each_request_is_one_line_with_what_the_client_got_and_the_ledger_billed(tmp_path: Path) -> None:
    log = tmp_path / "access.jsonl"
    with serve_stack(tmp_path, gateway_table={"access_log": "access.jsonl"}) as stack:
        collected = post(stack, "col-1")
        again = post(stack, "col-1")  # the same id once more: refused, a line of its own
        unknown = post(stack, "bad-key", key="fg-nobody-" + "z" * 24)
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.keys["beta"], max_retries=0)
        chunks = list(
            client.chat.completions.create(**streamed_chat("emu", "hi", 5, extra_headers={"X-Request-Id": "str-1"}))
        )
        reservations = by_id(stack.reservations())
    assert (collected.status_code, again.status_code, unknown.status_code) == (200, 409, 401)
    lines = {line["request_id"]: line for line in lines_of(log) if line["request_id"] != "col-1"}
    first, second = [line for line in lines_of(log) if line["request_id"] == "col-1"]
    assert len(lines_of(log)) == 4
    # The collected call: what the client was shown is what the ledger billed, and so is the line.
    billed = reservations["col-1"].billed
    assert collected.json()["usage"]["completion_tokens"] == billed.output_tokens == first["output_tokens"] == 6
    assert (first["status"], first["outcome"], first["input_tokens"]) == (200, "completed", billed.input_tokens)
    assert first["gpu_ms"] == pytest.approx(billed.gpu_ms, abs=1e-3) and first["gpu_ms"] > 0
    assert first["tenant_hash"] == tenant_tag("alpha") and "alpha" not in json.dumps(first)
    assert (first["model"], first["path"], first["upstream"]) == ("emu", "/v1/completions", "emu-0")
    assert first["trace_id"] is None  # no [telemetry]: no trace to name
    assert 0 <= first["queue_ms"] <= first["ttft_incl_queue_ms"] <= first["latency_ms"]
    # The re-sent id: a rejection, billed nothing, its reason and code as answered.
    assert (second["status"], second["outcome"], second["reason"]) == (409, "rejected", "conflict")
    assert second["code"] == again.json()["error"]["code"] and second["output_tokens"] == 0
    assert second["upstream"] is None and second["ttft_incl_queue_ms"] is None
    # No credential: nobody to attribute it to.
    bad = lines["bad-key"]
    assert (bad["status"], bad["tenant_hash"], bad["reason"], bad["code"]) == (401, None, "auth", "invalid_api_key")
    # The stream: the tokens the client received, billed, and logged.
    received = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
    stream = lines["str-1"]
    assert received == reservations["str-1"].billed.output_tokens == stream["output_tokens"] == 5
    assert (stream["status"], stream["outcome"], stream["tenant_hash"]) == (200, "completed", tenant_tag("beta"))


def test_one_ttft_the_queue_included_in_the_access_log_the_event_log_and_metrics(tmp_path: Path) -> None:
    """TTFT is measured from admission (the queue included) wherever it is shown, and named so; the event log
    also keeps the upstream's part, from dispatch, under its own name."""
    from fairgate.gateway.eventlog import read_records
    from tests.gateway.test_metrics import ADMIN_KEY

    with serve_stack(tmp_path, admin_key=ADMIN_KEY, gateway_table={"access_log": "access.jsonl"}) as stack:
        assert post(stack, "one-ttft").status_code == 200
        metrics = httpx.get(f"{stack.url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10).text
    [line] = lines_of(tmp_path / "access.jsonl")
    [finished] = [r for _, _, r in read_records(stack.config.event_log_path) if r["event"] == "finished"]
    assert "ttft_ms" not in line and "ttft_ms" not in finished
    assert line["ttft_incl_queue_ms"] == finished["ttft_incl_queue_ms"] > 0
    assert finished["ttft_incl_queue_ms"] == pytest.approx(
        finished["queue_ms"] + finished["first_token_after_dispatch_ms"], abs=2e-3
    )
    assert 0 < finished["first_token_after_dispatch_ms"] <= finished["ttft_incl_queue_ms"] <= line["latency_ms"]
    tag = tenant_tag("alpha")
    [observed] = [x for x in metrics.splitlines() if x.startswith(f'fairgate_ttft_seconds_sum{{tenant="{tag}"}}')]
    assert float(observed.split()[-1]) * 1000.0 == pytest.approx(line["ttft_incl_queue_ms"], abs=1e-3)


def test_a_stream_the_client_leaves_is_logged_cancelled_with_what_was_billed(tmp_path: Path) -> None:
    log = tmp_path / "access.jsonl"
    with serve_stack(tmp_path, gateway_table={"access_log": "access.jsonl"}) as stack:
        body = {**BODY, "max_tokens": 2000, "stream": True}
        headers = {"Authorization": f"Bearer {stack.keys['alpha']}", "X-Request-Id": "cut-1"}
        with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, headers=headers, timeout=30) as response:
            received = 0
            for line in response.iter_lines():
                received += line.startswith("data: {")
                if received == 10:
                    break  # the client hangs up mid-stream
        [reservation] = stack.reservations()
        for _ in range(200):  # the final settlement of a cut stream runs after the hang-up
            if reservation.is_final:
                break
            [reservation] = stack.reservations()
    [line] = lines_of(log)
    assert (line["request_id"], line["status"], line["outcome"]) == ("cut-1", 200, "cancelled")
    assert line["output_tokens"] == reservation.billed.output_tokens >= received
    assert line["output_tokens"] < 2000


def test_stderr_by_default_and_off_with_an_empty_value(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    with serve_stack(tmp_path / "default") as stack:
        assert post(stack, "to-stderr").status_code == 200
    logged = [json.loads(line) for line in capfd.readouterr().err.splitlines() if line.startswith('{"ts"')]
    assert [(line["request_id"], line["status"]) for line in logged] == [("to-stderr", 200)]
    with serve_stack(tmp_path / "off", gateway_table={"access_log": ""}) as stack:
        assert post(stack, "nowhere").status_code == 200
    assert "nowhere" not in capfd.readouterr().err


def test_an_access_log_that_cannot_be_written_stops_the_start_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "a-directory").mkdir()
    path, _ = write_config(tmp_path, ["http://127.0.0.1:9"], gateway_table={"access_log": "a-directory"})
    done = fairgate("serve", "--config", str(path), "--port", str(free_port()), timeout=60)
    assert done.returncode == 2, done.stderr
    assert "gateway.access_log:" in done.stderr and "not a regular file" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_internal_error_is_answered_500_and_still_logged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by an outside tester: an exception that is no rejection (here a delegation secret too short,
    set after the gateway started) reached the client as a 500 with no access-log line."""
    monkeypatch.setenv("FG_TEST_SHORT_SECRET", "abc")
    log = tmp_path / "access.jsonl"
    with serve_stack(
        tmp_path, gateway_table={"access_log": "access.jsonl"}, delegates=["alpha"], secret_env="FG_TEST_SHORT_SECRET"
    ) as stack:
        headers = {
            "Authorization": f"Bearer {stack.keys['alpha']}",
            "X-Request-Id": "boom",
            "X-Fairgate-On-Behalf-Of": "x.y",
        }
        answer = httpx.post(f"{stack.url}/v1/completions", json=BODY, headers=headers, timeout=30)
    assert answer.status_code == 500 and answer.json()["error"]["code"] == "internal_error"
    [line] = lines_of(log)
    assert (line["request_id"], line["status"], line["outcome"]) == ("boom", 500, "error")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('"\\u0000"', "gateway.access_log: a file path without control characters"),
        ('"   "', "gateway.access_log: a file path, not blank"),
        ('"fairgate.toml"', "fairgate.toml is also the configuration"),
        ('"fairgate-events.jsonl"', "fairgate-events.jsonl is also gateway.event_log"),
    ],
)
def test_an_access_log_value_that_cannot_work_is_one_error(tmp_path: Path, value: str, message: str) -> None:
    from fairgate.gateway.config import GatewayConfigError, load_gateway_config

    path, _ = write_config(tmp_path, ["http://127.0.0.1:9"], gateway_table={"access_log": "placeholder"})
    path.write_text(path.read_text().replace('access_log = "placeholder"', f"access_log = {value}"))
    assert value in path.read_text()
    with pytest.raises(GatewayConfigError) as error:
        load_gateway_config(path)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_fifo_as_access_log_stops_the_start_with_one_line(tmp_path: Path) -> None:
    import os

    os.mkfifo(tmp_path / "pipe")
    path, _ = write_config(tmp_path, ["http://127.0.0.1:9"], gateway_table={"access_log": "pipe"})
    done = fairgate("serve", "--config", str(path), "--port", str(free_port()), timeout=60)
    assert done.returncode == 2 and "gateway.access_log" in done.stderr and "not a regular file" in done.stderr
