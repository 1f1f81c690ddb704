"""A queued request whose client left since the queue's last disconnect check is not sent upstream when it
gets its slot (a tester saw 8 such requests prefilled together after a mass hang-up, billed ~1.1 s)."""

from __future__ import annotations

import asyncio

import httpx

from fairgate.emulator.api import create_app
from fairgate.gateway import queueing
from fairgate.harness.tap import EmulatorTap
from fairgate.ledger import Usage
from tests.gateway.conftest import EMULATOR, Stack, serve_stack

BLOCKER = {"model": "emu", "prompt": "x", "max_tokens": 150, "ignore_eos": True}
LATE = {"model": "emu", "prompt": "x gone-before-its-slot", "max_tokens": 5, "ignore_eos": True}


async def _leave_while_queued(stack: Stack) -> None:
    headers = {"Authorization": f"Bearer {stack.keys['alpha']}"}
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        blockers = [  # every slot of the replica (max_batch 4), for about a second
            asyncio.ensure_future(
                http.post("/v1/completions", json=BLOCKER, headers={**headers, "X-Request-Id": f"b{i}"})
            )
            for i in range(4)
        ]
        await asyncio.sleep(0.3)
        try:  # the client gives up while its request waits for a slot
            await http.post("/v1/completions", json=LATE, headers={**headers, "X-Request-Id": "late"}, timeout=0.3)
            raise AssertionError("answered while every slot was taken")
        except httpx.TimeoutException:
            pass
        assert all(r.status_code == 200 for r in await asyncio.gather(*blockers))  # the slots free: "late" gets one
        await asyncio.sleep(0.3)


def test_a_request_whose_client_left_is_not_sent_when_it_gets_its_slot(tmp_path, monkeypatch):
    monkeypatch.setattr(queueing, "DISCONNECT_CHECK_S", 60.0)  # only the check at the slot can see it leave
    tap = EmulatorTap(create_app(EMULATOR))
    with serve_stack(tmp_path, upstream=tap) as stack:
        asyncio.run(_leave_while_queued(stack))
        [late] = [r for r in stack.reservations() if r.request_id == "late"]
        assert (late.status, late.billed) == ("cancelled", Usage())
        assert "gone-before-its-slot" not in tap.bodies  # never sent to the replica
        assert sum(len(b) for b in tap.bodies.values()) == 4  # the blockers were
