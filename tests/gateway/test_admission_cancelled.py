"""A request cancelled (its client gone) after its reserve but before admission hands it on - here while the
ledger takes its run claim - leaves nothing behind: its reservation is cancelled billing nothing and the
process forgets the request id, so a retry is served."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

from fairgate.api import CompletionRequest
from fairgate.gateway import admission, intake
from fairgate.gateway.app import build_state
from fairgate.gateway.config import load_gateway_config
from fairgate.gateway.identity import Caller
from fairgate.gateway.state import SystemClock
from fairgate.ledger import Usage, connect
from fairgate.ledger.deferred import DeferredLedger
from tests.gateway.conftest import write_config


class SlowFirstClaim(DeferredLedger):
    """The ledger, whose first ``claim`` waits until ``release`` is set (a slow ledger round trip)."""

    def __init__(self, ledger: Any) -> None:
        super().__init__(ledger.quotas, lambda: asyncio.sleep(0, ledger))
        self.waiting, self.release, self.slow = asyncio.Event(), asyncio.Event(), True

    async def claim(self, reservation_id: str, owner: str, lease_ms: float) -> Any:
        if self.slow:
            self.slow = False
            self.waiting.set()
            await self.release.wait()
        return await super().claim(reservation_id, owner, lease_ms)


async def test_a_request_cancelled_during_its_claim_leaves_no_reservation(tmp_path: Path) -> None:
    path, _ = write_config(tmp_path, ["http://127.0.0.1:9"])
    config = load_gateway_config(path)
    async with await connect(config.ledger_url, config.quotas) as real:
        slow = SlowFirstClaim(real)
        await slow.connect()
        state = build_state(config, (), SystemClock(), random.Random(1))
        state.open_ledger(slow)
        body = CompletionRequest.model_validate({"model": "emu", "prompt": "x", "max_tokens": 4})
        generation = intake.size_up(config, body, False, "cut-1", intake.Run())
        admitting = asyncio.ensure_future(admission.admit(state, Caller("alpha"), generation))
        await slow.waiting.wait()  # reserved; the claim is on its way
        admitting.cancel()
        slow.release.set()
        await asyncio.gather(admitting, return_exceptions=True)
        [r] = await real.reservations("alpha")
        assert (r.status, r.billed) == ("cancelled", Usage()), r
        assert len(state.calls) == 0
        again = await admission.admit(state, Caller("alpha"), generation)  # a retry is served (re-opened)
        assert again.reservation.id == r.id and not again.reservation.is_final
