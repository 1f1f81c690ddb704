"""The dashboard remembers (``fairgate.gateway.dashboard_history``): its samples are on disk, tenants hashed,
and a gateway started again on the same configuration shows them at once, the time it was down a gap."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from fairgate.emulator.api import create_app
from fairgate.gateway.app import create_gateway
from fairgate.gateway.config import load_gateway_config
from fairgate.gateway.dashboard_history import History, decode, encode
from fairgate.gateway.stats import PoolPoint, Sample, TenantPoint
from fairgate.harness.threads import serve_in_thread
from fairgate.ledger.base import tenant_tag
from tests.gateway.conftest import EMULATOR, post, write_config

ADMIN_KEY = f"fg-test-admin-{'h' * 24}"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
BODY = {"model": "emu", "prompt": "x y", "max_tokens": 3, "ignore_eos": True}


def sample(t_s: float, tenant: str = "acme", gpu_s: float = 1.5) -> Sample:
    point = TenantPoint(0.5, 0.25, 12.0, 80.0, 2.0, 0.0, 1, 0, 10.0, 6.0, gpu_s, 0.1, 3)
    return Sample(t_s, {tenant: point}, {"emu": PoolPoint(1.2, 0.98, 90.0, None)}, {"emu-0": 0.75})


def test_a_sample_is_written_with_its_tenant_hashed_and_read_back_by_name(tmp_path: Path) -> None:
    line = encode(sample(1_800_000_000.5))
    assert "acme" not in line and tenant_tag("acme") in line
    assert decode(line, {tenant_tag("acme"): "acme"}) == sample(1_800_000_000.5)
    assert list(decode(line, {}).tenants) == [tenant_tag("acme")]  # a tenant no longer configured: its hash


def test_the_file_keeps_the_last_samples_and_skips_what_is_not_one(tmp_path: Path) -> None:
    history = History(tmp_path / "h.jsonl", ["acme"], keep=3)
    for i in range(13):
        history.add(sample(1_800_000_000.0 + 2 * i, gpu_s=float(i)))
        history.flush()
    assert len(history.path.read_text().splitlines()) <= 4 * 3  # compacted: at most COMPACT_FACTOR x keep
    with history.path.open("a") as file:
        file.write("not json\n")
    loaded = History(history.path, ["acme"], keep=3).load()
    assert [s.tenants["acme"].gpu_s for s in loaded] == [11.0, 12.0]  # the broken line was one of the last 3


def test_a_restarted_gateway_shows_the_samples_it_had(tmp_path: Path) -> None:
    with serve_in_thread(create_app(EMULATOR)) as emulator:
        path, keys = write_config(tmp_path, [emulator], admin_key=ADMIN_KEY)
        with serve_in_thread(create_gateway(load_gateway_config(path))) as url:
            deadline = time.monotonic() + 30
            while True:  # a sample every 2 s, taken as requests come
                assert post(url, keys["alpha"], BODY).status_code == 200
                before = httpx.get(f"{url}/dashboard/data", headers=ADMIN, timeout=10).json()
                if len(before["t"]) >= 3 and before["series"]["alpha"]["gpu_s"][-1]:
                    break
                assert time.monotonic() < deadline, before["t"]
                time.sleep(0.3)
        written = (tmp_path / "fairgate-dashboard.jsonl").read_text()
        assert "alpha" not in written and tenant_tag("alpha") in written
        down_s = 1.0
        time.sleep(down_s)
        with serve_in_thread(create_gateway(load_gateway_config(path))) as url:
            after = httpx.get(f"{url}/dashboard/data", headers=ADMIN, timeout=10).json()
    old = len(written.splitlines())
    assert old >= 3 and len(after["t"]) >= old
    # The samples from before the restart, by name, with the GPU seconds they had.
    assert after["series"]["alpha"]["gpu_s"][:old] == before["series"]["alpha"]["gpu_s"][:old]
    assert after["t"][old - 1] < -down_s  # taken before the gateway went down
