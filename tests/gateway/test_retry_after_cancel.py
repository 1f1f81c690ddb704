"""A request cancelled while it waited for a slot never ran: a retry with its request id is served
(issue 12, item 9)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from fairgate.ledger import Reservation, Usage, connect
from tests.gateway.conftest import Stack, serve_stack

LONG = {"model": "emu", "prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
BODY = {"model": "emu", "prompt": "x", "max_tokens": 5, "ignore_eos": True}


async def _mine(stack: Stack) -> Reservation:
    async with await connect(stack.ledger_url, stack.config.quotas) as ledger:
        [r] = [r for r in await ledger.reservations("alpha") if r.request_id == "retry-me"]
        return r


async def _hang_up_while_queued_then_retry(stack: Stack) -> httpx.Response:
    headers = {"Authorization": f"Bearer {stack.keys['alpha']}", "X-Request-Id": "retry-me"}
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        blockers: list[Any] = []  # every slot of the replica (max_batch 4), for about 2 s
        for i in range(4):
            cm = http.stream("POST", "/v1/completions", json=LONG, headers={**headers, "X-Request-Id": f"b{i}"})
            reply = await cm.__aenter__()
            lines = reply.aiter_lines()  # kept: an iterator dropped closes its stream (the client leaves)
            assert reply.status_code == 200 and (await lines.__anext__()).startswith("data: ")
            blockers.append((cm, lines))
        try:  # the client gives up while its request waits for a slot
            early = await http.post("/v1/completions", json=BODY, headers=headers, timeout=0.6)
            raise AssertionError(f"answered while every slot was taken: {early.status_code} {early.text}")
        except httpx.TimeoutException:
            pass
        await asyncio.sleep(0.8)  # the gateway's disconnect check (every 0.25 s) cancels it
        cancelled = await _mine(stack)
        assert (cancelled.status, cancelled.billed) == ("cancelled", Usage())
        retried = await http.post("/v1/completions", json=BODY, headers=headers)
        for cm, lines in blockers:
            await lines.aclose()
            await cm.__aexit__(None, None, None)
        return retried


def test_a_request_cancelled_while_queued_is_served_when_retried_with_its_id(tmp_path):
    with serve_stack(tmp_path) as stack:
        retried = asyncio.run(_hang_up_while_queued_then_retry(stack))
        assert retried.status_code == 200, retried.text
        assert retried.json()["usage"]["completion_tokens"] == 5
        r = asyncio.run(_mine(stack))
        assert (r.status, r.billed.output_tokens) == ("settled", 5)
        events = stack.ledger_call(lambda ledger: ledger.events("alpha"))
        mine = [(e.kind, e.output_tokens) for e in events if e.reservation_id == r.id]
        assert mine == [("reserve", 0), ("cancel", 0), ("reserve", 0), ("settle_final", 5)]  # billed once
