"""A gateway started while its ledger server does not answer starts anyway: it serves each tier's outage
policy (``reject``: 503; ``emergency``: its local budget) until the ledger answers, then serves normally - no
restart needed."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from fairgate.harness.redis import redis_server, redis_url
from fairgate.ledger.config import EmergencyConfig, TierConfig
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


def test_an_emergency_tier_is_served_from_its_budget_while_the_ledger_never_answered_and_billed_after(
    tmp_path: Path,
) -> None:
    """A gateway that has never reached its ledger still serves an ``emergency`` tier, from its local budget
    only (2 requests here), and once the ledger answers the grants are replayed: the ledger then holds each
    granted request, billed what its client received."""
    server = redis_server(tmp_path / "redis", durable=False)  # not started: nothing listens on its port
    tier = TierConfig(on_ledger_unavailable="emergency", emergency=EmergencyConfig(requests=2, tokens=1000, seconds=60))
    with serve_stack(tmp_path, ledger=redis_url(server, "emergency_at_start"), tiers={"beta": tier}) as stack:
        refused = post(stack.url, stack.keys["alpha"])
        granted = [post(stack.url, stack.keys["beta"], headers={"X-Request-Id": f"em-{i}"}) for i in range(3)]
        assert refused.status_code == 503, refused.text
        assert [r.status_code for r in granted] == [200, 200, 503], [r.text for r in granted]
        received = {f"em-{i}": granted[i].json()["usage"]["completion_tokens"] for i in range(2)}
        server.start()
        try:
            deadline = time.monotonic() + 15.0
            while time.monotonic() < deadline:
                held = {r.request_id: r for r in stack.reservations() if r.tenant == "beta"}
                if len(held) == 2 and all(r.status == "settled" for r in held.values()):
                    break
                time.sleep(0.2)
        finally:
            server.stop()
    assert {rid: r.billed.output_tokens for rid, r in held.items()} == received == {"em-0": 2, "em-1": 2}, held
