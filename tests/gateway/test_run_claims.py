"""One request id sent to two gateway processes sharing a ledger runs once: the reservation's run claim
(``Ledger.claim``) is the ledger's, not a process's. What the clients received is compared with what the
ledger holds and what the replica generated, per request id, on every backend."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from fairgate.core.cost import CostModel
from fairgate.emulator.api import create_app
from fairgate.gateway.app import create_gateway
from fairgate.gateway.config import load_gateway_config
from fairgate.harness.ledger import drop_ledger
from fairgate.harness.threads import serve_in_thread
from fairgate.ledger import Ledger
from tests.gateway.conftest import EMULATOR, REPLICA, ledger_call, write_config

REQUESTS = 6
MAX_TOKENS = 120  # ~0.6 s on the emulated replica: the second copy arrives while the first runs


async def _send_twice(urls: tuple[str, str], key: str, request_ids: list[str]) -> dict[str, list[httpx.Response]]:
    """Each request id streamed from the first gateway and, once its first token has arrived (it runs), sent
    to the second; the replies (the first read to its end)."""
    body = {"model": "emu", "prompt": "x", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}

    async def twice(http: httpx.AsyncClient, request_id: str) -> list[httpx.Response]:
        headers = {"Authorization": f"Bearer {key}", "X-Request-Id": request_id}
        first_url, second_url = urls
        async with http.stream("POST", f"{first_url}/v1/completions", json=body, headers=headers) as first:
            lines = first.aiter_lines()
            head = [line async for line in _until_data(lines)]
            second = await http.post(f"{second_url}/v1/completions", json=body, headers=headers)
            rest = [line async for line in lines]
        first._content = "\n".join(head + rest).encode()
        return [first, second]

    async with httpx.AsyncClient(timeout=60.0) as http:
        replies = await asyncio.gather(*(twice(http, rid) for rid in request_ids))
    return dict(zip(request_ids, replies, strict=True))


async def _until_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The lines up to and including the first ``data:`` line (the first token)."""
    async for line in lines:
        yield line
        if line.startswith("data:"):
            return


@pytest.mark.parametrize("backend", ["sqlite", "postgres", "redis"])
def test_one_request_id_sent_to_two_gateway_processes_runs_once(tmp_path: Path, backend: str, backend_url) -> None:  # type: ignore[no-untyped-def]
    url = backend_url(backend) if backend != "sqlite" else f"sqlite:///{tmp_path}/shared.db"
    request_ids = [f"twice-{n}" for n in range(REQUESTS)]
    with serve_in_thread(create_app(EMULATOR)) as emulator:
        configs = []
        for name in ("a", "b"):
            path, keys = write_config(tmp_path / name, [emulator], ledger=url)
            configs.append(load_gateway_config(path))
        try:
            with serve_in_thread(create_gateway(configs[0])) as a, serve_in_thread(create_gateway(configs[1])) as b:
                replies = asyncio.run(_send_twice((a, b), keys["alpha"], request_ids))
                stats = httpx.get(f"{emulator}/emulator/stats").json()
            reservations = ledger_call(configs[0], lambda ledger: ledger.reservations("alpha"))
        finally:
            ledger_call(configs[0], drop_ledger)
    for rid, (first, second) in replies.items():
        chunks = [json.loads(line[6:]) for line in first.text.splitlines() if line.startswith("data: {")]
        received = sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"])
        assert first.status_code == 200 and received == MAX_TOKENS, (rid, first.text)
        assert second.status_code == 409 and second.json()["error"]["code"] == "request_in_progress", second.text
        assert int(second.headers["retry-after"]) >= 1 and "x-should-retry" not in second.headers
    # What the ledger holds: one reservation per id, billed what its client received; the replica ran each once.
    assert sorted(r.request_id for r in reservations) == sorted(request_ids)
    assert all((r.status, r.billed.output_tokens) == ("settled", MAX_TOKENS) for r in reservations), reservations
    assert stats["sequences_finished"] == REQUESTS and stats["tokens_generated"] == REQUESTS * MAX_TOKENS, stats
    assert stats["running"] == 0


# Long enough for gateway B to start and answer its first request while A's claims hold, on a loaded machine.
CLAIM_MS = 3000.0


def test_a_request_that_ran_on_a_process_that_stopped_is_not_run_again(tmp_path: Path) -> None:
    """Process A (gone) reserved two requests: one it had started (settled at its first token), one still
    queued (nothing billed). Once A's run claims lapse, their clients' retries on B: the started one is closed
    billing what A settled (409: send a new id), the queued one runs."""
    with serve_in_thread(create_app(EMULATOR)) as emulator:
        path, keys = write_config(tmp_path, [emulator])
        config = load_gateway_config(path)
        cost = CostModel(REPLICA.iter_base_ms, REPLICA.iter_slope_ms, REPLICA.prefill_ms_per_token, REPLICA.max_batch)

        async def as_process_a(ledger: Ledger) -> None:
            for request_id, ran in (("started", True), ("queued", False)):
                r = await ledger.reserve("alpha", request_id, 1, 10, cost.worst_case_ms(1, 10), "emu")
                await ledger.claim(r.id, "gateway-a", CLAIM_MS)
                if ran:
                    await ledger.settle(r.id, 1, 1, 5.0)

        ledger_call(config, as_process_a)
        claimed_at = time.monotonic()
        body = {"model": "emu", "prompt": "x", "max_tokens": 10}
        with serve_in_thread(create_gateway(config)) as b:
            headers = {"Authorization": f"Bearer {keys['alpha']}", "X-Request-Id": "started"}
            early = httpx.post(f"{b}/v1/completions", json=body, headers=headers, timeout=30)
            assert time.monotonic() - claimed_at < CLAIM_MS / 1000.0  # it was early: the claims still held
            time.sleep(max(0.0, claimed_at + CLAIM_MS / 1000.0 + 0.1 - time.monotonic()))  # A's claims lapse
            started = httpx.post(f"{b}/v1/completions", json=body, headers=headers, timeout=30)
            headers["X-Request-Id"] = "queued"
            queued = httpx.post(f"{b}/v1/completions", json=body, headers=headers, timeout=30)
        rows = {r.request_id: r for r in ledger_call(config, lambda ledger: ledger.reservations("alpha"))}
    assert early.status_code == 409 and early.json()["error"]["code"] == "request_in_progress", early.text
    assert started.status_code == 409 and started.json()["error"]["code"] == "request_already_completed"
    assert "stopped" in started.json()["error"]["message"]
    assert (rows["started"].status, rows["started"].billed.output_tokens) == ("cancelled", 1), rows["started"]
    assert queued.status_code == 200 and rows["queued"].status == "settled", queued.text
