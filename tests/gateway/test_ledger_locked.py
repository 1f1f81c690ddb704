"""Issue 12, item 6, through a real gateway: while another process holds the SQLite ledger's write lock,
/health answers at once, a ``reject`` tier's request gets a quick 503 and an ``emergency`` tier's is served
from its emergency budget - within the ledger's busy timeout (``DEFAULT_BUSY_TIMEOUT_MS``, 2 s), not when the
lock is released."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from fairgate.emulator.api import create_app
from fairgate.gateway.app import create_gateway
from fairgate.gateway.config import GatewaySection, load_gateway_config
from fairgate.harness.config import TenantSpec, gateway_file, quota_file
from fairgate.harness.threads import serve_in_thread
from fairgate.ledger.config import EmergencyConfig, LimitsConfig, TierConfig
from fairgate.ledger.sqlite import DEFAULT_BUSY_TIMEOUT_MS
from tests.gateway.conftest import BODY, EMULATOR, REPLICA, post
from tests.ledger.test_sqlite_locked import locked

BUSY_S = DEFAULT_BUSY_TIMEOUT_MS / 1000
KEYS = {"free": f"fg-test-free-{'x' * 24}", "paid": f"fg-test-paid-{'x' * 24}"}


def _config(tmp: Path, upstream: str) -> Path:
    section = GatewaySection(ledger=f"sqlite:///{tmp}/ledger.db", journal=f"{tmp}/journal.jsonl", default_max_tokens=64)
    tiers = {
        "free": TierConfig(),  # on_ledger_unavailable = reject
        "paid": TierConfig(
            on_ledger_unavailable="emergency", emergency=EmergencyConfig(requests=5, tokens=10_000, seconds=60)
        ),
    }
    tenants = [TenantSpec(name, tier=name) for name in KEYS]
    quotas = quota_file(tenants, tiers, LimitsConfig(max_queued=64))
    path = tmp / "fairgate.toml"
    gateway_file(section, [REPLICA.upstream("emu-0", upstream, "emu")], quotas, KEYS).write(path)
    return path


@pytest.mark.serial  # timing-sensitive (asserts the busy timeout's seconds): runs alone after the parallel part
def test_a_locked_sqlite_ledger_gets_each_tier_its_outage_policy_quickly(tmp_path: Path) -> None:
    with serve_in_thread(create_app(EMULATOR)) as emulator:
        config = load_gateway_config(_config(tmp_path, emulator))
        with serve_in_thread(create_gateway(config)) as gateway:
            assert post(gateway, KEYS["free"]).status_code == 200  # the ledger made and working
            with locked(tmp_path / "ledger.db", 20.0):
                replies: dict[str, tuple[httpx.Response, float]] = {}

                def send(tenant: str) -> None:
                    started = time.perf_counter()
                    reply = post(gateway, KEYS[tenant], dict(BODY, max_tokens=3))
                    replies[tenant] = reply, time.perf_counter() - started

                waiting = threading.Thread(target=send, args=("free",))
                waiting.start()
                time.sleep(0.3)  # the free tier's reserve now waits for the lock
                started = time.perf_counter()
                health = httpx.get(f"{gateway}/health", timeout=10)
                health_s = time.perf_counter() - started
                waiting.join()
                send("paid")
            free, free_s = replies["free"]
            paid, paid_s = replies["paid"]
    assert health.status_code == 200 and health_s < 0.1
    assert free.status_code == 503 and free.json()["error"]["code"] == "ledger_unavailable"
    assert 0.9 * BUSY_S < free_s < BUSY_S + 1.0  # the busy timeout, not the 20 s the lock was held
    assert paid.status_code == 200 and paid.json()["usage"]["completion_tokens"] == 3
    assert paid_s < 2 * BUSY_S + 1.0  # reserve and settle each wait at most the busy timeout
    journal = [json.loads(line) for line in (tmp_path / "journal.jsonl").read_text().splitlines()]
    assert [r["tenant"] for r in journal if r["type"] == "grant"] == ["paid"]
