"""A request cancelled (its client gone) while admission waits for the ledger leaves nothing behind: the reserve
that takes its run claim has committed, so its reservation is cancelled billing nothing once the answer comes and
the process forgets the request id, so a retry is served - here, or at once on another process."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from fairgate.api import CompletionRequest
from fairgate.gateway import admission, intake
from fairgate.gateway.app import build_state
from fairgate.gateway.config import load_gateway_config
from fairgate.gateway.identity import Caller
from fairgate.gateway.outcomes import Outcome, Rejection
from fairgate.gateway.state import SystemClock
from fairgate.ledger import Usage, connect
from fairgate.ledger.deferred import DeferredLedger
from tests.gateway.conftest import write_config


class SlowFirstAnswer(DeferredLedger):
    """The ledger, whose first ``reserve`` commits and then answers only once ``release`` is set (a slow round
    trip back)."""

    def __init__(self, ledger: Any) -> None:
        super().__init__(ledger.quotas, lambda: asyncio.sleep(0, ledger))
        self.waiting, self.release, self.slow = asyncio.Event(), asyncio.Event(), True

    async def reserve_args(self, args: Any, claim_owner: Any = None, claim_lease_ms: float = 0.0) -> Any:
        reserved = await super().reserve_args(args, claim_owner, claim_lease_ms)
        if self.slow:
            self.slow = False
            self.waiting.set()
            await self.release.wait()
        return reserved


async def test_a_request_cancelled_during_its_reserve_leaves_no_reservation(tmp_path: Path) -> None:
    path, _ = write_config(tmp_path, ["http://127.0.0.1:9"])
    config = load_gateway_config(path)
    async with await connect(config.ledger_url, config.quotas) as real:
        slow = SlowFirstAnswer(real)
        await slow.connect()
        state = build_state(config, (), SystemClock(), random.Random(1))
        state.open_ledger(slow)
        body = CompletionRequest.model_validate({"model": "emu", "prompt": "x", "max_tokens": 4})
        generation = intake.size_up(config, body, False, "cut-1", intake.Run())
        admitting = asyncio.ensure_future(admission.admit(state, Caller("alpha"), generation))
        await slow.waiting.wait()  # reserved and claimed; the answer is on its way
        [r] = await real.reservations("alpha")
        assert (await real.claim(r.id, "another-process", 1000.0)).owner == state.process_id
        admitting.cancel()
        slow.release.set()
        await asyncio.gather(admitting, return_exceptions=True)
        assert admitting.cancelled()
        [r] = await real.reservations("alpha")
        assert (r.status, r.billed) == ("cancelled", Usage()), r
        assert len(state.calls) == 0
        again = await admission.admit(state, Caller("alpha"), generation)  # a retry is served (re-opened)
        assert again.reservation.id == r.id and not again.reservation.is_final
        assert again.reservation.claim is not None and again.reservation.claim.held_by(state.process_id)


async def test_a_request_id_served_here_is_refused_without_touching_its_claim(tmp_path: Path) -> None:
    """A copy of a request this process serves now is refused (409) by the process's own registry: its reserve
    asks for no run claim, so the claim stays as the running call's sweep left it."""
    path, _ = write_config(tmp_path, ["http://127.0.0.1:9"])
    config = load_gateway_config(path)
    async with await connect(config.ledger_url, config.quotas) as real:
        state = build_state(config, (), SystemClock(), random.Random(1))
        state.open_ledger(real)
        body = CompletionRequest.model_validate({"model": "emu", "prompt": "x", "max_tokens": 4})
        generation = intake.size_up(config, body, False, "twice-here", intake.Run())
        first = await admission.admit(state, Caller("alpha"), generation)
        assert first.reservation.claim is not None
        until_ms = first.reservation.claim.until_ms
        with pytest.raises(Rejection) as refused:
            await admission.admit(state, Caller("alpha"), generation)
        assert refused.value.outcome is Outcome.REQUEST_IN_PROGRESS
        held = await real.claim(first.reservation.id, "another-process", 1000.0)
        assert (held.owner, held.until_ms) == (state.process_id, until_ms)  # not renewed by the refused copy
