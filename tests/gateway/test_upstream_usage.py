"""A replica that reports a usage count the ledger cannot take (negative, null, text, a flag, absurdly large)
is billed from the gateway's own counts: the reservation is settled once, the client is answered, and the
same request id is not run again."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from fairgate.gateway.upstream import billable_usage
from tests.gateway.conftest import serve_stack

WORDS = ["one", " two", " three"]


def replica_reporting(usage: dict[str, Any]) -> Starlette:
    """An OpenAI-compatible replica that streams ``WORDS`` and then reports ``usage`` as it is."""

    async def chat(request: Request) -> StreamingResponse:
        await request.body()

        async def events() -> AsyncIterator[str]:
            for word in WORDS:
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': word}}]})}\n\n"
            yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {}, 'finish_reason': 'stop'}]})}\n\n"
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


@pytest.mark.parametrize(
    ("usage", "billed_output"),
    [
        ({"prompt_tokens": -5, "completion_tokens": 999_999}, 3),  # the output count is capped at max_tokens
        # 2 for the 3 pieces relayed: each took a token, so the client is billed the 3 it received
        ({"prompt_tokens": None, "completion_tokens": 2}, 3),
        ({"prompt_tokens": None, "completion_tokens": 3}, 3),
        ({"prompt_tokens": "abc", "completion_tokens": "abc"}, 3),
        ({"prompt_tokens": True, "completion_tokens": 1.5}, 3),
        ({"prompt_tokens": 10**12, "completion_tokens": -1}, 3),
    ],
)
def test_a_usage_count_the_ledger_refuses_is_billed_from_the_gateways_own(
    tmp_path: Path, usage: dict[str, Any], billed_output: int
) -> None:
    with serve_stack(tmp_path, replica_reporting(usage)) as stack:
        body = {"model": "emu", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
        headers = {"Authorization": f"Bearer {stack.keys['alpha']}", "X-Request-Id": "bad-usage-1"}
        first = httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers=headers, timeout=30)
        again = httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert first.status_code == 200 and first.json()["choices"][0]["message"]["content"] == "one two three"
    assert again.status_code == 409  # the id was served: not run a second time
    [reservation] = stack.reservations()
    assert reservation.request_id == "bad-usage-1" and reservation.status == "settled"
    estimate = reservation.input_tokens  # the gateway's own prompt count, reserved at admission
    assert estimate > 0 and reservation.billed.input_tokens == estimate
    assert reservation.billed.output_tokens == billed_output


def test_billable_usage_keeps_whole_counts_in_range() -> None:
    assert billable_usage({"prompt_tokens": 7, "completion_tokens": 0, "total_tokens": 7}) == {
        "prompt_tokens": 7,
        "completion_tokens": 0,
    }
    assert billable_usage({"prompt_tokens": -1, "completion_tokens": 4}) == {"completion_tokens": 4}
    assert billable_usage({"prompt_tokens": 10_000_001}) is None
    assert billable_usage(["prompt_tokens", 3]) is None and billable_usage(None) is None


def test_a_prompt_the_upstream_counts_far_above_the_estimate_is_billed_as_read_and_flagged(
    tmp_path: Path, caplog
) -> None:  # type: ignore[no-untyped-def]
    """The estimate was 2 tokens; the upstream says 1,500, which this model's 2,048-token context allows: the
    tenant used them, so all 1,500 are billed (the reservation is closed, not left to expire billing 0), the
    call is logged and the reconciliation flags it."""
    admin = "sk-admin-usage-0123456789"
    reporting = replica_reporting({"prompt_tokens": 1500, "completion_tokens": 3})
    with serve_stack(tmp_path, reporting, admin_key=admin) as stack:
        body = {"model": "emu", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
        headers = {"Authorization": f"Bearer {stack.keys['alpha']}"}
        reply = httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers=headers, timeout=30)
        [r] = stack.reservations()
        events = stack.ledger_call(lambda ledger: ledger.events("alpha"))
        report = httpx.get(f"{stack.url}/admin/reconcile", headers={"Authorization": f"Bearer {admin}"}).json()
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == 1500, reply.text
    assert r.status == "settled" and r.billed.input_tokens == 1500 > 2 * r.input_tokens + 1024, r
    assert sum(e.input_tokens for e in events) == 1500, events
    assert any("usage_above_reservation" in m and '"input_tokens": 1500' in m for m in caplog.messages)
    [row] = report["tenants"]
    assert row["input_above_reservation"] == {"count": 1, "request_ids": [r.request_id]} and report["clean"], row


def test_a_prompt_count_past_every_context_is_not_believed(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    """5,000 prompt tokens cannot have been read by an engine with a 2,048-token context: the count is not
    believed, the estimate is billed, and the upstream is named in the log."""
    with serve_stack(tmp_path, replica_reporting({"prompt_tokens": 5000, "completion_tokens": 3})) as stack:
        body = {"model": "emu", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
        headers = {"Authorization": f"Bearer {stack.keys['alpha']}"}
        reply = httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers=headers, timeout=30)
        [r] = stack.reservations()
    assert reply.status_code == 200, reply.text
    assert r.status == "settled" and r.billed.input_tokens == r.input_tokens, r
    assert any("usage_contradicts_relay" in m and '"prompt_tokens": 5000' in m for m in caplog.messages)


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x" * 60_000}}]}]},
        {"messages": [{"role": "user", "content": "hi"}], "extra_document": "y" * 60_000},
        {"prompt": "hi", "extra_document": "y " * 30_000},
    ],
)
def test_every_part_the_upstream_receives_is_estimated(tmp_path: Path, body: dict[str, Any]) -> None:
    """60 KB in an image part or an unknown field is ~7,500 tokens, not 5: over this model's 2,048-token
    context, refused before anything is reserved."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    with serve_stack(tmp_path) as stack:
        headers = {"Authorization": f"Bearer {stack.keys['alpha']}"}
        reply = httpx.post(f"{stack.url}{path}", json={"model": "emu", **body}, headers=headers, timeout=30)
        assert stack.reservations() == []
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "context_length_exceeded", reply.text
