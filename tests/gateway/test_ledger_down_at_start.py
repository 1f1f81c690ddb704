"""A gateway started while its ledger server does not answer starts anyway: it serves each tier's outage
policy (here ``reject``: 503) until the ledger answers, then serves normally - no restart needed."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from fairgate.harness.redis import redis_server, redis_url
from tests.gateway.conftest import post, serve_stack


def test_a_gateway_started_during_a_ledger_outage_serves_once_the_ledger_answers(tmp_path: Path) -> None:
    server = redis_server(tmp_path / "redis", durable=False)  # not started: nothing listens on its port
    with serve_stack(tmp_path, ledger=redis_url(server, "down_at_start")) as stack:
        assert httpx.get(f"{stack.url}/health", timeout=5).status_code == 200
        down = post(stack.url, stack.keys["alpha"])
        assert down.status_code == 503 and down.json()["error"]["code"] == "ledger_unavailable", down.text
        server.start()
        try:
            deadline = time.monotonic() + 10.0
            while (reply := post(stack.url, stack.keys["alpha"])).status_code == 503 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert reply.status_code == 200, reply.text
            [r] = stack.reservations()
            assert r.status == "settled" and r.billed.output_tokens == 2
        finally:
            server.stop()
