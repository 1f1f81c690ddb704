"""An upstream that misbehaves - HTML instead of an event stream, broken SSE framing, a stall, a connection
closed before the headers or mid-stream, usage that contradicts what it streamed - gets the client a clear
error (502, 504 for a stall before anything was relayed, or a terminal SSE error event once the stream has
started), a reservation settled by what the client received, and one warning line naming the upstream and
what it did. The real gateway runs in front of ``fairgate.harness.bad_upstream`` over loopback HTTP; what
each client received is compared with what the ledger holds for its request id."""

from __future__ import annotations

import json
import logging
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from fairgate.gateway.app import create_gateway
from fairgate.gateway.call import RELAY_CHUNKS_PER_WRITE_MAX
from fairgate.gateway.config import load_gateway_config
from fairgate.harness.bad_upstream import (
    CUT_AFTER,
    LATE_FIRST_S,
    PAST_MAX_TOKENS,
    PIECE,
    TOKENS,
    BadUpstream,
    serve_bad_upstream,
)
from fairgate.harness.threads import serve_in_thread
from fairgate.ledger import Reservation, Usage
from tests.gateway.conftest import Stack, write_config

IDLE_S = 0.5  # the upstream's stream_idle_timeout_s here
MAX_TOKENS = 50
UPSTREAM = "emu-0"  # write_config's name for the one upstream
BEFORE_ANYTHING = {  # mode -> (the client's status, the problem logged)
    "html_502": (502, "http_status"),
    "html_200": (502, "not_event_stream"),
    "garbage_first": (502, "malformed_stream"),
    "tool_calls_first": (502, "malformed_stream"),  # a chunk whose tool_calls is a number
    "fan_choices": (502, "malformed_stream"),  # one chunk of 200 choice entries for n = 1
    "keepalive_only": (504, "stalled"),  # comments do not reset the idle clock
    "endless_line": (502, "malformed_stream"),
    "stall_head": (504, "stalled"),
    "stall_first": (504, "stalled"),
    "close_head": (502, "connection_closed"),
}
MID_STREAM = {  # mode -> (the collected client's status, the problem logged)
    "garbage_line": (502, "malformed_stream"),
    "garbage_same_read": (502, "malformed_stream"),  # the good pieces and the broken line in one read
    "tool_calls_line": (502, "malformed_stream"),  # a chunk whose tool_calls is a number
    "not_json_same_read": (502, "malformed_stream"),
    "data_not_json": (502, "malformed_stream"),
    "no_choices": (502, "malformed_stream"),
    "error_event": (502, "malformed_stream"),
    "stall_mid": (504, "stalled"),
    "close_mid": (502, "connection_closed"),
    "eof_mid": (502, "stream_unfinished"),
}


@contextmanager
def serve_misbehaving(tmp: Path, idle_s: float) -> Iterator[tuple[Stack, BadUpstream]]:
    """A gateway in front of one misbehaving upstream, with that upstream's idle timeout ``idle_s``."""
    with serve_bad_upstream() as upstream:
        path, keys = write_config(tmp, [upstream.url])
        config = load_gateway_config(path)
        idle = [u.model_copy(update={"stream_idle_timeout_s": idle_s}) for u in config.upstreams]
        config = config.model_copy(update={"upstreams": idle})
        with serve_in_thread(create_gateway(config)) as gateway:
            yield Stack(gateway, keys, path, config), upstream


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One gateway in front of one misbehaving upstream (idle timeout ``IDLE_S``) for the whole module."""
    with serve_misbehaving(tmp_path_factory.mktemp("misbehave"), IDLE_S) as (stack, _):
        yield stack


def ask(stack: Stack, prompt: str, stream: bool, request_id: str) -> httpx.Response:
    body = {"model": "emu", "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS}
    headers = {"Authorization": f"Bearer {stack.keys['alpha']}", "X-Request-Id": request_id}
    return httpx.post(f"{stack.url}/v1/chat/completions", json={**body, "stream": stream}, headers=headers, timeout=30)


def exchange(stack: Stack, mode: str, stream: bool, rest: str) -> tuple[str, httpx.Response, Reservation]:
    """Asks for ``mode`` (the prompt starts with it, ``rest`` follows) under a fresh request id; returns the
    id, the reply and the request's reservation once final."""
    request_id = f"{mode}-{uuid.uuid4().hex[:8]}"
    reply = ask(stack, f"{mode}{rest}", stream, request_id)
    return request_id, reply, final(stack, request_id)


def events(reply: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]


def pieces(chunks: list[dict[str, Any]]) -> int:
    """Text pieces the client received in ``chunks``."""
    return sum(1 for c in chunks for choice in c.get("choices") or [] if (choice.get("delta") or {}).get("content"))


def final(stack: Stack, request_id: str, wait_s: float = 10.0) -> Reservation:
    """The reservation of ``request_id`` once it is final (a stream's is settled after its last event)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = [r for r in stack.reservations() if r.request_id == request_id]
        if (found and found[0].is_final) or time.monotonic() > deadline:
            [reservation] = found
            return reservation
        time.sleep(0.05)


def warnings(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    """The gateway's warning lines so far about calls, parsed (each is one JSON object). The fake upstream
    answers faster than its cost model says, which the drift check rightly reports: not a call's line."""
    lines = [
        json.loads(r.getMessage())
        for r in caplog.records
        if r.name.startswith("fairgate") and r.levelno >= logging.WARNING
    ]
    return [line for line in lines if line.get("event") != "cost_model_drift"]


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("mode", sorted(BEFORE_ANYTHING))
def test_a_failure_before_anything_was_relayed_is_a_clear_error_billed_nothing(
    stack: Stack, caplog: pytest.LogCaptureFixture, mode: str, stream: bool
) -> None:
    status, problem = BEFORE_ANYTHING[mode]
    request_id, reply, reservation = exchange(stack, mode, stream, " please")
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["code"] == "upstream_error" and UPSTREAM in error["message"] and "<html>" not in error["message"]
    assert (reservation.status, reservation.billed) == ("cancelled", Usage()), reservation
    [line] = warnings(caplog)
    assert line["event"] == "upstream_failed" and (line["upstream"], line["problem"]) == (UPSTREAM, problem), line
    assert line["request_id"] == request_id and line["delivered"] is False
    if mode == "endless_line":  # cut at the gateway's line limit, not read whole first
        assert "a line longer than 1048576 bytes" in line["error"], line


@pytest.mark.parametrize("mode", sorted(MID_STREAM))
def test_a_stream_broken_after_it_started_ends_with_an_error_event_and_bills_what_was_received(
    stack: Stack, caplog: pytest.LogCaptureFixture, mode: str
) -> None:
    _request_id, reply, reservation = exchange(stack, mode, True, " please")
    chunks = events(reply)
    assert reply.status_code == 200 and "data: [DONE]" not in reply.text, reply.text
    assert chunks[-1]["error"]["code"] == "upstream_error" and UPSTREAM in chunks[-1]["error"]["message"]
    received = pieces(chunks)
    assert received == CUT_AFTER
    assert reservation.status == "cancelled" and reservation.billed.output_tokens == received, reservation
    assert reservation.billed.input_tokens == reservation.input_tokens > 0
    [line] = warnings(caplog)
    assert (line["event"], line["upstream"], line["problem"]) == ("upstream_failed", UPSTREAM, MID_STREAM[mode][1])
    assert line["delivered"] is True and line["billed"]["output_tokens"] == received


@pytest.mark.parametrize("mode", sorted(MID_STREAM))
def test_a_collected_call_broken_mid_stream_delivered_nothing_and_bills_nothing(
    stack: Stack, caplog: pytest.LogCaptureFixture, mode: str
) -> None:
    status, problem = MID_STREAM[mode]
    _request_id, reply, reservation = exchange(stack, mode, False, " please")
    assert reply.status_code == status and reply.json()["error"]["code"] == "upstream_error", reply.text
    assert (reservation.status, reservation.billed) == ("cancelled", Usage()), reservation
    [line] = warnings(caplog)
    assert (line["event"], line["upstream"], line["problem"], line["delivered"]) == (
        "upstream_failed",
        UPSTREAM,
        problem,
        False,
    )
    assert line["unbilled"]["output_tokens"] == CUT_AFTER  # what the upstream generated, logged not billed


USAGE = {  # mode -> (what is billed: input tokens from the estimate?, output tokens, the warning's event or None)
    "usage_low": (True, TOKENS, "usage_contradicts_relay"),  # reports 1 of 6 pieces relayed
    "usage_under": (True, TOKENS, "usage_contradicts_relay"),  # 4 of 6: the client is billed all 6 it received
    "usage_high": (True, TOKENS, "usage_contradicts_relay"),  # reports 1,000 for 12 bytes of text
    "usage_prompt_zero": (True, TOKENS, "usage_contradicts_relay"),  # reports a 400-word prompt as 0 tokens
    "usage_slack": (False, TOKENS + 3, None),  # EOS and kin: a few tokens more is billed as reported
    # honest usage, on the wire in ways the relay must read whole: every event cut across two reads, and a
    # last [DONE] with no newline before the connection closes (the prompt reported is the one estimated)
    "split_lines": (True, TOKENS, None),
    "done_without_newline": (True, TOKENS, None),
}
LONG = " x" * 400  # a prompt the gateway estimates at 400 tokens and more


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("mode", sorted(USAGE))
def test_usage_that_contradicts_what_was_relayed_is_billed_from_the_relay(
    stack: Stack, caplog: pytest.LogCaptureFixture, mode: str, stream: bool
) -> None:
    from_estimate, billed_output, event = USAGE[mode]
    request_id, reply, reservation = exchange(stack, mode, stream, LONG)
    assert reply.status_code == 200, reply.text
    if stream:
        assert reply.text.rstrip().endswith("data: [DONE]") and pieces(events(reply)) == TOKENS, reply.text
    else:
        document = reply.json()
        assert document["choices"][0]["message"]["content"] == PIECE * TOKENS
        assert document["usage"]["completion_tokens"] == billed_output  # the client is shown what is billed
    assert reservation.status == "settled" and reservation.billed.output_tokens == billed_output, reservation
    estimate = reservation.input_tokens  # the gateway's own count, reserved at admission
    assert (reservation.billed.input_tokens == estimate) is from_estimate, reservation
    lines = warnings(caplog)
    assert [line["event"] for line in lines] == ([event] if event else []), lines
    if event:
        assert lines[0]["upstream"] == UPSTREAM and lines[0]["request_id"] == request_id
        assert lines[0]["billed"] == {"input_tokens": estimate, "output_tokens": TOKENS}


@pytest.mark.parametrize(
    ("mode", "field"),
    [
        ("past_max_tokens", "content"),
        ("reasoning_past_max_tokens", "reasoning_content"),
        ("tool_calls_past_max_tokens", "tool_calls"),
        ("function_call_past_max_tokens", "function_call"),
    ],
)
def test_an_upstream_past_max_tokens_in_one_read_is_stopped_before_the_piece_over_and_billed_max_tokens(
    stack: Stack, mode: str, field: str
) -> None:
    """The relay sends the pieces of one upstream read together (``RELAY_CHUNKS_PER_WRITE_MAX`` a write), yet
    checks ``max_tokens`` at every piece: of the upstream's 200 in one read, the client gets the 50 asked for,
    then the terminal error, and is billed those 50 (the piece that would run over is not relayed). Reasoning
    and tool-call deltas are pieces as content is (found by a helper: 200 relayed, billed 0)."""
    assert PAST_MAX_TOKENS > MAX_TOKENS + RELAY_CHUNKS_PER_WRITE_MAX
    _request_id, reply, reservation = exchange(stack, mode, True, " please")
    chunks = events(reply)
    assert reply.status_code == 200 and "data: [DONE]" not in reply.text, reply.text
    assert chunks[-1]["error"]["code"] == "max_tokens_exceeded", chunks[-1]
    received = sum(1 for c in chunks for choice in c.get("choices") or [] if (choice.get("delta") or {}).get(field))
    assert received == MAX_TOKENS
    assert reservation.status == "settled" and reservation.billed.output_tokens == MAX_TOKENS, reservation


def test_one_choice_past_its_max_tokens_is_stopped_though_the_total_is_within_n_times_it(stack: Stack) -> None:
    """OpenAI's ``max_tokens`` is per choice: with ``n`` = 2 and ``max_tokens`` = 5, an upstream putting 10
    pieces in choice 0 is stopped before its sixth, and billed the 5 relayed."""
    body = {"model": "emu", "messages": [{"role": "user", "content": "one_choice_for_two"}], "max_tokens": 5, "n": 2}
    request_id = f"n2-{uuid.uuid4().hex[:8]}"
    headers = {"Authorization": f"Bearer {stack.keys['alpha']}", "X-Request-Id": request_id}
    reply = httpx.post(f"{stack.url}/v1/chat/completions", json={**body, "stream": True}, headers=headers, timeout=30)
    reservation = final(stack, request_id)
    chunks = events(reply)
    assert chunks[-1]["error"]["code"] == "max_tokens_exceeded" and "per choice" in chunks[-1]["error"]["message"]
    assert pieces(chunks) == 5 and reservation.billed.output_tokens == 5, reservation


@pytest.mark.parametrize(
    ("mode", "billed_output"), [("usage_high", TOKENS), ("usage_slack", TOKENS + 3), ("honest", TOKENS)]
)
def test_a_client_that_asks_for_usage_is_shown_what_is_billed(stack: Stack, mode: str, billed_output: int) -> None:
    """The usage event a streamed client asked for (``stream_options.include_usage``) comes last, before
    ``[DONE]``, with the billed counts (found by a helper: an upstream's 1,000 was relayed, 6 billed)."""
    request_id = f"{mode}-{uuid.uuid4().hex[:8]}"
    body = {"model": "emu", "messages": [{"role": "user", "content": f"{mode}{LONG}"}], "max_tokens": MAX_TOKENS}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {stack.keys['alpha']}", "X-Request-Id": request_id}
    reply = httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers=headers, timeout=30)
    reservation = final(stack, request_id)
    chunks = events(reply)
    [shown] = [c for c in chunks if c.get("usage")]
    assert shown is chunks[-1] and shown["choices"] == [] and reply.text.rstrip().endswith("data: [DONE]")
    assert (shown["usage"]["prompt_tokens"], shown["usage"]["completion_tokens"]) == (
        reservation.billed.input_tokens,
        reservation.billed.output_tokens,
    )
    assert reservation.billed.output_tokens == billed_output and pieces(chunks) == TOKENS


def test_a_streamed_client_gone_before_the_first_token_stops_the_call_at_once(tmp_path: Path) -> None:
    """Found by a helper: the call, its slot and its meter outlived such a client until the first token came
    (3.8 s), and it was billed tokens it never received. Now it is watched until the first write, as a
    collected call is: final well before that token, billed no output. (The upstream's idle timeout is
    longer than the wait for the first token here, so only the hang-up can end the call early.)"""
    with serve_misbehaving(tmp_path, idle_s=30.0) as (stack, _):
        _hang_up_before_the_first_token(stack)


def _hang_up_before_the_first_token(stack: Stack) -> None:
    request_id = f"late-{uuid.uuid4().hex[:8]}"
    host, port = stack.url.split("//")[1].split(":")
    body = json.dumps({"model": "emu", "messages": [{"role": "user", "content": "late_first x"}], "stream": True})
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {stack.keys['alpha']}\r\nx-request-id: {request_id}\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port))) as client:
        client.sendall(head.encode() + body.encode())
        time.sleep(0.3)
    left = time.monotonic()
    reservation = final(stack, request_id, wait_s=LATE_FIRST_S + 5.0)
    assert reservation.is_final and reservation.final_ms is not None
    assert time.monotonic() - left < LATE_FIRST_S - 1.0, "the call outlived its client until the first token"
    assert reservation.status == "cancelled" and reservation.billed.output_tokens == 0, reservation


def test_a_piece_before_a_usage_chunk_the_client_did_not_ask_for_is_written_at_once(stack: Stack) -> None:
    """Found by a helper: a piece whose read ended with a usage chunk the client did not ask for waited for
    the upstream's next read; here the upstream then stalls, and the piece must come a whole idle timeout
    before the error event that ends the stream, not with it."""
    request_id = f"hold-{uuid.uuid4().hex[:8]}"
    body = {"model": "emu", "messages": [{"role": "user", "content": "usage_then_stall"}], "stream": True}
    headers = {"Authorization": f"Bearer {stack.keys['alpha']}", "X-Request-Id": request_id}
    seen: dict[str, float] = {}
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json=body, headers=headers, timeout=30) as reply:
        for line in reply.iter_lines():
            if '"content"' in line:
                seen.setdefault("piece", time.monotonic())
            if '"upstream_error"' in line:
                seen["error"] = time.monotonic()
    assert seen["error"] - seen["piece"] >= IDLE_S / 2, seen
    assert final(stack, request_id).billed.output_tokens == 1


def test_the_openai_client_reads_a_stall_mid_stream_as_an_error_and_is_billed_what_it_read(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.keys["beta"], max_retries=0, timeout=30)
    request_id = f"openai-{uuid.uuid4().hex[:8]}"
    text = []
    with pytest.raises(openai.APIError, match=f"upstream {UPSTREAM} sent nothing for {IDLE_S:g} s"):
        for chunk in client.chat.completions.create(
            model="emu",
            messages=[{"role": "user", "content": "stall_mid please"}],
            max_tokens=MAX_TOKENS,
            stream=True,
            extra_headers={"X-Request-Id": request_id},
        ):
            text += [choice.delta.content for choice in chunk.choices if choice.delta.content]
    reservation = final(stack, request_id)
    assert len(text) == CUT_AFTER and reservation.status == "cancelled"
    assert reservation.billed.output_tokens == len(text)
    [line] = warnings(caplog)
    assert (line["event"], line["problem"], line["upstream"]) == ("upstream_failed", "stalled", UPSTREAM)


def test_the_openai_client_gets_a_502_for_a_proxys_html_page(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.keys["beta"], max_retries=0, timeout=30)
    with pytest.raises(openai.InternalServerError) as raised:
        client.chat.completions.create(model="emu", messages=[{"role": "user", "content": "html_502 please"}])
    assert raised.value.status_code == 502 and f"upstream {UPSTREAM} answered 502" in raised.value.message


def test_a_completions_text_beside_an_empty_delta_is_a_piece(stack: Stack) -> None:
    """Found by a helper: such pieces were relayed and billed 0."""
    request_id = f"text-{uuid.uuid4().hex[:8]}"
    body = {"model": "emu", "prompt": "text_beside_delta", "max_tokens": MAX_TOKENS, "stream": True}
    headers = {"Authorization": f"Bearer {stack.keys['alpha']}", "X-Request-Id": request_id}
    reply = httpx.post(f"{stack.url}/v1/completions", json=body, headers=headers, timeout=30)
    received = sum(1 for c in events(reply) for choice in c.get("choices") or [] if choice.get("text"))
    assert reply.status_code == 200 and received == TOKENS
    assert final(stack, request_id).billed.output_tokens == TOKENS


def test_a_collected_answer_holds_the_tool_calls_and_reasoning_it_is_billed_for(stack: Stack) -> None:
    """Found by a helper: a collected answer came back with content "" and no tool_calls (tool calling without
    streaming did not work), billed the pieces it dropped."""
    request_id = f"tools-{uuid.uuid4().hex[:8]}"
    reply = ask(stack, "tools_and_reasoning please", False, request_id)
    [choice] = reply.json()["choices"]
    message = choice["message"]
    assert message["reasoning_content"] == PIECE * 2 and message["content"] is None
    assert message["tool_calls"] == [
        {"type": "function", "id": "call_1", "function": {"name": "f", "arguments": PIECE * 3}}
    ]
    assert choice["finish_reason"] == "tool_calls"
    assert final(stack, request_id).billed.output_tokens == 6


def test_a_stream_stopped_at_max_tokens_shows_the_usage_its_client_asked_for(stack: Stack) -> None:
    request_id = f"usage-stop-{uuid.uuid4().hex[:8]}"
    body = {"model": "emu", "messages": [{"role": "user", "content": "past_max_tokens"}], "max_tokens": MAX_TOKENS}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {stack.keys['alpha']}", "X-Request-Id": request_id}
    chunks = events(httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers=headers, timeout=30))
    assert chunks[-1]["error"]["code"] == "max_tokens_exceeded"
    assert chunks[-2]["usage"]["completion_tokens"] == MAX_TOKENS == final(stack, request_id).billed.output_tokens
