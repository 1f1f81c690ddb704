"""``/health/live`` (the process serves HTTP; ``/health`` is its alias) and ``/health/ready`` (requests can be
admitted: the ledger answers or an emergency policy covers its outage, and every model has an upstream up),
with the per-upstream ``fairgate_upstream_up`` gauge."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from fairgate.gateway.app import create_gateway
from fairgate.gateway.background import PROBE_EVERY_S
from fairgate.gateway.config import load_gateway_config
from fairgate.harness.redis import redis_server, redis_url
from fairgate.harness.threads import serve_in_thread
from tests.gateway.conftest import post, serve_stack, write_config

ADMIN_KEY = f"fg-test-admin-{'x' * 24}"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def test_a_serving_gateway_is_live_and_ready(tmp_path: Path) -> None:
    with serve_stack(tmp_path, admin_key=ADMIN_KEY) as stack:
        live = httpx.get(f"{stack.url}/health/live", timeout=5)
        ready = httpx.get(f"{stack.url}/health/ready", headers=ADMIN, timeout=5)
        anonymous = httpx.get(f"{stack.url}/health/ready", timeout=5)
        metrics = httpx.get(f"{stack.url}/metrics", headers=ADMIN, timeout=5).text
    assert live.status_code == 200 and live.json() == {"status": "ok"}
    assert ready.status_code == 200, ready.text
    assert ready.json() == {"status": "ready", "ledger": "ok", "upstreams_up": {"emu": 1}, "reasons": []}
    assert anonymous.status_code == 200
    assert anonymous.json() == {"status": "ready", "ledger": "ok", "models_ready": 1, "models": 1, "reasons": []}
    assert 'fairgate_upstream_up{model="emu",upstream="emu-0"} 1.0' in metrics


def test_a_model_with_every_upstream_down_is_not_ready(tmp_path: Path) -> None:
    path, keys = write_config(tmp_path, ["http://127.0.0.1:9"], admin_key=ADMIN_KEY)  # nothing listens: refused
    with serve_in_thread(create_gateway(load_gateway_config(path))) as url:
        assert post(url, keys["alpha"]).status_code in (502, 503)  # the refusal marks it down
        ready = httpx.get(f"{url}/health/ready", headers=ADMIN, timeout=5)
        anonymous = httpx.get(f"{url}/health/ready", headers={"Authorization": f"Bearer {keys['alpha']}"}, timeout=5)
        live = httpx.get(f"{url}/health", timeout=5)
        metrics = httpx.get(f"{url}/metrics", headers=ADMIN, timeout=5).text
    assert live.status_code == 200
    assert ready.status_code == 503 and ready.json()["reasons"] == ["no upstream of model 'emu' is up"], ready.text
    # Not an admin key (a tenant's): the model's name is left out, which models are down is counted.
    assert anonymous.status_code == 503 and "emu" not in anonymous.text, anonymous.text
    assert anonymous.json()["reasons"] == ["1 of 1 models have no upstream up (an admin key shows which)"]
    assert (anonymous.json()["models_ready"], anonymous.json()["models"]) == (0, 1)
    assert 'fairgate_upstream_up{model="emu",upstream="emu-0"} 0.0' in metrics


def test_an_upstream_nothing_listens_at_is_not_ready_without_a_request_failing_first(tmp_path: Path) -> None:
    # The probe asks every upstream each PROBE_EVERY_S: one that refuses the connection is down at once. Only
    # marked down by a request that failed, a gateway in front of two dead ports read ready, both up (a new user's
    # finding), and an orchestrator sent it traffic.
    path, _ = write_config(tmp_path, ["http://127.0.0.1:9"], admin_key=ADMIN_KEY)  # nothing listens: refused
    with serve_in_thread(create_gateway(load_gateway_config(path))) as url:
        deadline, ready = time.monotonic() + 10 * PROBE_EVERY_S, None
        while time.monotonic() < deadline:
            ready = httpx.get(f"{url}/health/ready", headers=ADMIN, timeout=5)
            if ready.status_code == 503:
                break
            time.sleep(PROBE_EVERY_S / 4)
        metrics = httpx.get(f"{url}/metrics", headers=ADMIN, timeout=5).text
    assert ready is not None and ready.status_code == 503, ready.text if ready is not None else None
    assert ready.json()["reasons"] == ["no upstream of model 'emu' is up"]
    assert 'fairgate_upstream_up{model="emu",upstream="emu-0"} 0.0' in metrics


def test_a_ledger_that_does_not_answer_with_no_emergency_tier_is_not_ready(tmp_path: Path) -> None:
    server = redis_server(tmp_path / "redis", durable=False)  # never started
    with serve_stack(tmp_path, ledger=redis_url(server, "health")) as stack:
        ready = httpx.get(f"{stack.url}/health/ready", timeout=5)
    assert ready.status_code == 503 and ready.json()["ledger"] == "unavailable", ready.text
    assert "the ledger does not answer and no tier has an emergency policy" in ready.json()["reasons"]
