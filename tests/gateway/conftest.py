"""A real gateway in front of real emulated replicas, over loopback HTTP, with a real SQLite ledger."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fairgate.emulator.api import EmulatorSettings, create_app
from fairgate.gateway.app import create_gateway
from fairgate.gateway.auth import hash_api_key
from fairgate.gateway.config import load_gateway_config
from tests.support.servers import serve

EMULATOR = EmulatorSettings(
    model="emu",
    iter_base_ms=4.0,
    iter_slope_ms=0.25,
    prefill_ms_per_token=0.01,
    max_batch=4,
    output_mean_tokens=20.0,
    max_model_len=2048,
)
TENANTS = ("alpha", "beta", "gamma")


@dataclass
class Stack:
    url: str  # the gateway's base URL
    keys: dict[str, str]  # tenant -> API key
    ledger_url: str
    config_path: Path


def write_config(
    tmp: Path, upstream_urls: list[str], extra_quotas: str = "", policy: str = "gpu_fair", defaults: str = ""
) -> tuple[Path, dict[str, str]]:
    keys = {tenant: f"fg-test-{tenant}-{'x' * 24}" for tenant in TENANTS}
    upstreams = "".join(
        f'[[upstream]]\nname = "emu-{i}"\nurl = "{url}/v1"\nmodel = "emu"\nmax_batch = 4\niter_base_ms = 4.0\n'
        f"iter_slope_ms = 0.25\nprefill_ms_per_token = 0.01\nmax_model_len = 2048\n"
        for i, url in enumerate(upstream_urls)
    )
    tenants = "".join(f'[quotas.tenants.{t}]\ntier = "free"\n' for t in TENANTS)
    key_tables = "".join(f'[[key]]\ntenant = "{t}"\nhash = "{hash_api_key(k)}"\n' for t, k in keys.items())
    text = (
        f'[gateway]\npolicy = "{policy}"\nledger = "sqlite:///{tmp}/ledger.db"\njournal = "{tmp}/journal.jsonl"\n'
        f"default_max_tokens = 64\nmax_body_bytes = 65536\n\n{upstreams}\n"
        f'[quotas.tiers.free]\non_ledger_unavailable = "reject"\n'
        f"[quotas.defaults]\n{'' if 'max_queued' in defaults else 'max_queued = 64'}\n{defaults}\n{tenants}"
        f"{extra_quotas}\n{key_tables}"
    )
    path = tmp / "fairgate.toml"
    path.write_text(text)
    return path, keys


@pytest.fixture
def stack(tmp_path) -> Iterator[Stack]:  # type: ignore[no-untyped-def]
    with serve(create_app(EMULATOR)) as emulator:
        path, keys = write_config(tmp_path, [emulator])
        config = load_gateway_config(path)
        with serve(create_gateway(config)) as gateway:
            yield Stack(gateway, keys, config.ledger_url, path)
