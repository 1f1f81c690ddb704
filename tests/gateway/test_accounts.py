"""Tenant limits over real HTTP hold across the tenant's models (issue 12, item 4)."""

from __future__ import annotations

from fairgate.emulator.api import create_app
from fairgate.gateway.app import create_gateway
from fairgate.gateway.config import load_gateway_config
from fairgate.harness.threads import serve_in_thread
from fairgate.ledger.config import LimitsConfig
from tests.gateway.conftest import REPLICA, post_at_once, write_config


def test_max_concurrent_holds_across_the_tenants_models(tmp_path):
    with (
        serve_in_thread(create_app(REPLICA.settings("emu"))) as first,
        serve_in_thread(create_app(REPLICA.settings("emu-2"))) as second,
    ):
        path, keys = write_config(
            tmp_path, [first, second], defaults=LimitsConfig(max_concurrent=3), models=["emu", "emu-2"]
        )
        with serve_in_thread(create_gateway(load_gateway_config(path))) as url:
            # Six streams, three per model, each long enough (300 tokens at >= 4 ms an iteration) to overlap.
            bodies = [
                {"model": model, "prompt": "x", "max_tokens": 300, "ignore_eos": True, "stream": True}
                for model in ("emu", "emu-2") * 3
            ]
            replies = post_at_once([(url, keys["alpha"], body, None) for body in bodies])
    codes = sorted(r.status_code for r in replies)
    assert codes == [200] * 3 + [429] * 3, [r.text[:200] for r in replies]
    assert all("max_concurrent" in r.json()["error"]["message"] for r in replies if r.status_code == 429)
