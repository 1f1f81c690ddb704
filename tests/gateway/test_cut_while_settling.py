"""A request that ran is not run again under its reservation while the ledger does not hold its end (drill
``retry``, pattern ``timeout``: one reservation run twice on the replicas):

- a collected request whose client leaves while the gateway settles it (the upstream done, its final
  settlement waiting in the ledger's queue) is still settled, and a retry with its request id is not run:
  the client's disconnect cancels the call's task, and that cancellation (asyncio's own, which an anyio
  shielded scope does not stop on a plain asyncio task) must not reach the settlement;
- one whose final settlement the ledger could not take (journalled for replay) is not run again by a retry
  before the replay.

What the clients received is compared with what the ledger holds and what the replica generated."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx

from fairgate.emulator.api import create_app
from fairgate.gateway.app import create_gateway
from fairgate.gateway.config import GatewayConfig, load_gateway_config
from fairgate.gateway.state import state_of
from fairgate.harness.threads import serve_in_thread
from fairgate.ledger import LedgerUnavailable, Reservation, connect
from fairgate.ledger.config import Quotas
from fairgate.ledger.deferred import DeferredLedger
from tests.gateway.conftest import EMULATOR, ledger_call, write_config

BODY = {"model": "emu", "prompt": "x", "max_tokens": 5, "ignore_eos": True}
# How long the first final settlement waits (a busy ledger's queue): 20 times the gateway's disconnect check
# of a collected call (every 0.05 s), so the client's disconnect is seen while it waits.
HOLD_S = 1.0


class HeldSettle(DeferredLedger):
    """The ledger, whose first final settlement (``FINAL``; else its first partial one) waits ``HOLD_S`` before
    it is written (``written`` is set once it is); like a call queued for a busy ledger, the wait can be
    cancelled, and then nothing is written."""

    FINAL = True

    def __init__(self, quotas: Quotas, url: str) -> None:
        super().__init__(quotas, lambda: connect(url, quotas))
        self.holding, self.done, self.written = threading.Event(), threading.Event(), threading.Event()
        self.held = False
        self.cancelled = False

    async def settle(
        self, reservation_id: str, input_tokens: int, output_tokens: int, gpu_ms: float, final: bool = False
    ) -> Reservation:
        if final != self.FINAL or self.held:
            return await super().settle(reservation_id, input_tokens, output_tokens, gpu_ms, final)
        self.held = True
        self.holding.set()
        try:
            await asyncio.sleep(HOLD_S)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        finally:
            self.done.set()
        try:
            return await super().settle(reservation_id, input_tokens, output_tokens, gpu_ms, final)
        finally:
            self.written.set()


class HeldFinalSettle(HeldSettle):
    FINAL = True


class HeldPartialSettle(HeldSettle):
    FINAL = False


def _send(url: str, key: str, request_id: str) -> socket.socket:
    """A connection that has sent a collected completion request (and reads nothing yet)."""
    body = json.dumps(BODY).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\nX-Request-Id: {request_id}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(head.encode() + body)
    return sock


def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


L = TypeVar("L", bound=DeferredLedger)


@contextmanager
def _replica_and_ledger(
    tmp_path: Path, make_ledger: Callable[[Quotas, str], L]
) -> Iterator[tuple[str, dict[str, str], GatewayConfig, L]]:
    """An emulated replica, a gateway config for it (``write_config``) and ``make_ledger(quotas, url)``
    connected: yields the replica's URL, the tenants' keys, the config and the ledger; closes them after."""
    with serve_in_thread(create_app(EMULATOR)) as emulator:
        path, keys = write_config(tmp_path, [emulator])
        config = load_gateway_config(path)
        ledger = make_ledger(config.quotas, config.ledger_url)
        asyncio.run(ledger.connect())
        try:
            yield emulator, keys, config, ledger
        finally:
            asyncio.run(ledger.close())


def _assert_run_and_billed_once(request_id: str, retries: list[httpx.Response], emulator: str, config: Any) -> None:
    """Every retry was refused as already completed; the ledger holds one reservation, billed once what the
    replica generated (5 tokens) for its one run; the replica ran it once, to the end."""
    for retried in retries:
        assert retried.status_code == 409, retried.text
        assert retried.json()["error"]["code"] == "request_already_completed", retried.text
    stats = httpx.get(f"{emulator}/emulator/stats").json()
    [r] = ledger_call(config, lambda ledger: ledger.reservations("alpha"))
    events = ledger_call(config, lambda ledger: ledger.events("alpha"))
    assert (r.request_id, r.status, r.billed.output_tokens) == (request_id, "settled", 5), r
    assert [(e.kind, e.output_tokens) for e in events if e.reservation_id == r.id] == [
        ("reserve", 0),
        ("settle_final", 5),
    ]
    finished = ("sequences_finished", "sequences_cancelled", "tokens_generated", "running")
    assert tuple(stats[k] for k in finished) == (1, 0, 5, 0), stats


def test_a_collected_call_cut_while_it_settles_is_settled_once_and_not_run_again(tmp_path: Path) -> None:
    with _replica_and_ledger(tmp_path, HeldFinalSettle) as (emulator, keys, config, held):
        app = create_gateway(config, held)
        with serve_in_thread(app) as gateway:
            original = _send(gateway, keys["alpha"], "cut-1")
            assert held.holding.wait(10)  # the upstream is done; its final settlement waits
            original.setblocking(False)
            try:
                unanswered = original.recv(1) == b""
            except BlockingIOError:
                unanswered = True
            original.close()  # the client gives up
            assert held.done.wait(10)
            _until(lambda: len(state_of(app).calls) == 0)
            headers: dict[str, Any] = {"Authorization": f"Bearer {keys['alpha']}", "X-Request-Id": "cut-1"}
            retried = httpx.post(f"{gateway}/v1/completions", json=BODY, headers=headers, timeout=30)
        _assert_run_and_billed_once("cut-1", [retried], emulator, config)
    assert unanswered
    assert not held.cancelled, "the client's disconnect cancelled the final settlement"


class FinalSettleDown(DeferredLedger):
    """The ledger, which cannot take a final ``settle`` until ``up`` is set (an outage of that one write)."""

    def __init__(self, quotas: Quotas, url: str) -> None:
        super().__init__(quotas, lambda: connect(url, quotas))
        self.up = threading.Event()

    async def settle(
        self, reservation_id: str, input_tokens: int, output_tokens: int, gpu_ms: float, final: bool = False
    ) -> Reservation:
        if final and not self.up.is_set():
            raise LedgerUnavailable("the final settlement cannot reach the ledger")
        return await super().settle(reservation_id, input_tokens, output_tokens, gpu_ms, final)


def test_a_request_whose_final_settlement_failed_is_not_run_again_by_a_retry(tmp_path: Path) -> None:
    with _replica_and_ledger(tmp_path, FinalSettleDown) as (emulator, keys, config, down):
        headers = {"Authorization": f"Bearer {keys['alpha']}", "X-Request-Id": "lost-1"}
        with serve_in_thread(create_gateway(config, down)) as gateway:
            served = httpx.post(f"{gateway}/v1/completions", json=BODY, headers=headers, timeout=30)
            early = httpx.post(f"{gateway}/v1/completions", json=BODY, headers=headers, timeout=30)
            down.up.set()  # the journal's replay (every second) settles it
            _until(lambda: ledger_call(config, lambda ledger: ledger.reservations("alpha"))[0].is_final)
            late = httpx.post(f"{gateway}/v1/completions", json=BODY, headers=headers, timeout=30)
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 5, served.text
        _assert_run_and_billed_once("lost-1", [early, late], emulator, config)


def test_a_streams_first_token_reaches_its_client_only_once_the_ledger_holds_it(tmp_path: Path) -> None:
    """The ledger learns a stream ran before its client sees a token, so a gateway killed at any point after
    that leaves a reservation billed, whose retry on another process is refused: with the ledger slow to
    write, the first token waits for it (and is billed by the time the client has it)."""
    with _replica_and_ledger(tmp_path, HeldPartialSettle) as (_, keys, config, held):
        headers = {"Authorization": f"Bearer {keys['alpha']}", "X-Request-Id": "first-1"}
        body = {**BODY, "stream": True}
        with (
            serve_in_thread(create_gateway(config, held)) as gateway,
            httpx.stream("POST", f"{gateway}/v1/completions", json=body, headers=headers, timeout=30) as reply,
        ):
            lines = reply.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            ledger_had = held.written.is_set()
            [r] = ledger_call(config, lambda ledger: ledger.reservations("alpha"))
            rest = [line for line in lines if line]
    assert '"text"' in first and rest[-1] == "data: [DONE]", (first, rest[-3:])
    assert ledger_had and r.billed.output_tokens >= 1, r
