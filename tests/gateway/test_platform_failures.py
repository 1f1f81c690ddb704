"""A call the platform fails - the upstream refuses it or dies - before the client has received anything is
not the tenant's to pay: its reservation is cancelled billing nothing. Once the client has received tokens,
what it received is billed. What each client received is compared with what the ledger holds."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fairgate.ledger import Usage
from tests.gateway.conftest import serve_stack


def replica_failing(tokens_before_dying: int | None) -> Starlette:
    """A replica that answers 401 (``None``), or streams ``tokens_before_dying`` tokens and drops the connection."""

    async def completions(request: Request) -> Response:
        await request.body()
        if tokens_before_dying is None:
            return JSONResponse({"error": {"message": "bad key", "code": "invalid_api_key"}}, status_code=401)

        async def events() -> AsyncIterator[str]:
            for _ in range(tokens_before_dying):
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': ' w'}]})}\n\n"
            # An engine dies between two iterations, after the gateway read what it sent (bytes still unread
            # in the gateway's buffer when the connection breaks are lost with it: see UpstreamClient._chunks).
            await asyncio.sleep(0.3)
            raise ConnectionResetError("replica died")

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


def _post(url: str, key: str, stream: bool) -> httpx.Response:
    body = {"model": "emu", "prompt": "a b c", "max_tokens": 50, "stream": stream}
    return httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)


@pytest.mark.parametrize(("tokens_before_dying", "stream"), [(None, False), (None, True), (20, False), (0, True)])
def test_a_call_failed_before_the_client_received_anything_bills_nothing(
    tmp_path: Path, tokens_before_dying: int | None, stream: bool
) -> None:
    with serve_stack(tmp_path, replica_failing(tokens_before_dying)) as stack:
        reply = _post(stack.url, stack.keys["alpha"], stream)
        [r] = stack.reservations()
        events = stack.ledger_call(lambda ledger: ledger.events("alpha"))
    assert reply.status_code >= 400 and "error" in reply.json(), reply.text
    assert (r.status, r.billed) == ("cancelled", Usage()), r
    assert sum(e.input_tokens + e.output_tokens for e in events) == 0 and sum(e.gpu_ms for e in events) == 0.0


def test_a_stream_cut_by_the_replica_bills_what_the_client_received(tmp_path: Path) -> None:
    with serve_stack(tmp_path, replica_failing(7)) as stack:
        reply = _post(stack.url, stack.keys["alpha"], stream=True)
        [r] = stack.reservations()
    chunks = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
    received = sum(1 for c in chunks if c.get("choices") and c["choices"][0].get("text"))
    assert received == 7 and chunks[-1]["error"]["code"] == "upstream_error", reply.text
    assert r.status == "cancelled" and r.billed.output_tokens == received and r.billed.input_tokens > 0, r


def test_a_refunded_failure_shows_in_the_tenants_usage_and_the_reconciliation(tmp_path: Path) -> None:
    """The refund is visible where the tenant and the operator look: what the failed calls used and were not
    billed, per request id; the upstream's 401 is answered as the platform's failure (502), not the client's."""
    admin = "sk-admin-refunds-0123456789"
    with serve_stack(tmp_path, replica_failing(None), admin_key=admin) as stack:
        replies = [_post(stack.url, stack.keys["alpha"], stream) for stream in (False, True)]
        usage = httpx.get(f"{stack.url}/v1/usage", headers={"Authorization": f"Bearer {stack.keys['alpha']}"}).json()
        report = httpx.get(f"{stack.url}/admin/reconcile", headers={"Authorization": f"Bearer {admin}"}).json()
        reservations = stack.reservations()
    assert [r.status_code for r in replies] == [502, 502], [r.text for r in replies]
    assert all((r.status, r.billed) == ("cancelled", Usage()) for r in reservations), reservations
    refunded = usage["refunded"]
    assert refunded["requests"] == 2 and refunded["output_tokens"] == 0, usage
    assert refunded["input_tokens"] == 2 * reservations[0].input_tokens, usage
    assert (usage["input_tokens"], usage["output_tokens"]) == (0, 0), usage
    assert usage["rejections"]["by_reason"]["upstream_error"] == 2, usage
    listed = report["refunded_platform_failures"]
    assert listed["total"] == 2 and report["clean"], report
    assert {r["request_id"] for r in listed["recent"]} == {r.request_id for r in reservations}, listed
    assert {(r["tenant"], r["upstream"], r["problem"]) for r in listed["recent"]} == {
        ("alpha", "emu-0", "auth_refused")
    }
    assert all(r["gpu_ms"] > 0 for r in listed["recent"]), listed
