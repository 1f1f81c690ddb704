"""A gateway process paused (SIGSTOP) past its run claims' lease, while a client retries the same request id on
another process: an outside tester's findings. A request queued on the paused process ran twice when it was
resumed (once there, once for the retry), billed once; a stream it was relaying was closed by the retry
(billing what had been settled) and then delivered the rest of its tokens unbilled.

Now a process holds each claim by its own clock: the lease from the moment the call that took or renewed it was
sent (``CallRegistry.run_claim_left_s``). A queued request whose claim is near its end is claimed again before it
is sent upstream (409 when another process holds it); a stream whose claim is lost stops at its next chunk once
the ledger says so, and what it delivered after its reservation closed is billed late (``<id>#late-``).

Two gateway processes (SQLite ledger, sweep 1 s: a 3 s lease) in front of one tapped replica with one slot a
gateway; every request carries its id as its last word, so the tap counts the times the replica ran it."""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

import httpx
import pytest

from fairgate.harness.config import TenantSpec
from fairgate.harness.replica import ReplicaModel
from fairgate.harness.stack import ReplicaSpec, Stack, StackSpec, start_stack
from fairgate.ledger.emergency import late_base

PAUSE_S = 6.0  # past the 3 s lease, renewed at most 1 s (a sweep) before the pause
SETTLE_EVERY_TOKENS = 64  # gateway/call.py: what a killed or paused stream may leave delivered and unbilled


def _spec() -> StackSpec:
    replica = ReplicaModel(iter_base_ms=20.0, iter_slope_ms=0.5, prefill_ms_per_token=0.05, max_batch=4)
    return StackSpec(
        tenants=(TenantSpec("alpha"),),
        replicas=(ReplicaSpec("emu", 1),),
        replica=replica,
        processes=False,
        gateway_process=True,
        gateways=2,
        sweep_s=1.0,
        tapped=True,
    )


async def _send(url: str, key: str, request_id: str, max_tokens: int) -> dict[str, Any]:
    """One streamed request under ``request_id``: its status, the tokens received, the error event's code."""
    body = {
        "model": "emu",
        "messages": [{"role": "user", "content": f"count {request_id}"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {key}", "x-request-id": request_id}
    out: dict[str, Any] = {"status": None, "tokens": 0, "error": None}
    async with (
        httpx.AsyncClient(timeout=60) as client,
        client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as reply,
    ):
        out["status"] = reply.status_code
        if reply.status_code != 200:
            out["error"] = json.loads(await reply.aread())["error"]["code"]
            return out
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"]["code"]
            elif event.get("choices") and event["choices"][0]["delta"].get("content"):
                out["tokens"] += 1
    return out


async def _paused_then_retried(stack: Stack, request_id: str, max_tokens: int, queued: bool) -> list[dict[str, Any]]:
    """``request_id`` sent to gateway 0 (behind a blocker taking its one slot when ``queued``), gateway 0 paused
    past the lease, the id retried on gateway 1, gateway 0 resumed. Returns the first client's and the retry's."""
    key, first_gateway, other = stack.keys["alpha"], stack.gateways[0], stack.gateways[1]
    assert first_gateway.process is not None
    blocker = asyncio.ensure_future(_send(first_gateway.url, key, f"{request_id}-blocker", 150)) if queued else None
    await asyncio.sleep(0.5)
    first = asyncio.ensure_future(_send(first_gateway.url, key, request_id, max_tokens))
    await asyncio.sleep(0.5 if queued else 1.0)
    first_gateway.process.send(signal.SIGSTOP)
    try:
        await asyncio.sleep(PAUSE_S)
        retry = await _send(other.url, key, request_id, max_tokens)
    finally:
        first_gateway.process.send(signal.SIGCONT)
    results = [await first, retry]
    if blocker is not None:
        await blocker
    return results


@pytest.mark.serial  # two gateway processes, one paused for 4.5 s: runs alone after the parallel part
def test_a_paused_process_runs_nothing_twice_and_delivers_nothing_unbilled_after_its_claims_lapse():
    with start_stack(_spec()) as stack:
        queued_first, queued_retry = asyncio.run(_paused_then_retried(stack, "q-1", 60, queued=True))
        stream_first, stream_retry = asyncio.run(_paused_then_retried(stack, "s-1", 400, queued=False))
        reservations = {r.request_id: r for r in asyncio.run(stack.reservations())}
        runs = {tag: len(seen) for tag, seen in stack.tapped().items()}
    # Queued when paused: the retry ran it (to its end before the resume); the resumed process did not (409: the
    # reservation is final, and the request was never sent upstream from there).
    assert (queued_first["status"], queued_first["error"]) == (409, "request_already_completed"), queued_first
    assert (queued_retry["status"], queued_retry["tokens"]) == (200, 60), queued_retry
    assert runs.get("q-1") == 1, runs
    assert reservations["q-1"].billed.output_tokens == 60, reservations["q-1"]
    # Streaming when paused: the retry is refused (it ran and billed: the reservation is closed with what was
    # settled), and the resumed stream stops once the ledger tells it its claim is lost; what it delivered after
    # the close is billed late, under a reservation of its own (``ResilientLedger._bill_late``).
    assert (stream_retry["status"], stream_retry["error"]) == (409, "request_already_completed"), stream_retry
    assert stream_first["error"] == "upstream_error" and stream_first["tokens"] < 400, stream_first
    assert runs.get("s-1") == 1, runs
    billed = sum(r.billed.output_tokens for r in reservations.values() if late_base(r.request_id) == "s-1")
    assert stream_first["tokens"] - SETTLE_EVERY_TOKENS <= billed <= stream_first["tokens"] + 4, (billed, stream_first)
    assert not [r for r in reservations.values() if r.status == "open"], reservations
