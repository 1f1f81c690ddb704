"""The drift check through a real gateway: a replica three times slower than the cost model the gateway
was given shows ``fairgate_upstream_step_drift_ratio`` near 3 on /metrics and one ``cost_model_drift``
warning naming the upstream; one that matches it shows a ratio near 1 and no warning."""

from __future__ import annotations

import logging

import httpx
import pytest

from fairgate.emulator.api import create_app
from tests.gateway.conftest import BODY, EMULATOR, REPLICA, post, serve_stack, slower

SLOW = slower(3.0)


ADMIN_KEY = "fg-test-admin-" + "d" * 24


def _ratio(url: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10).text
    [line] = [x for x in text.splitlines() if x.startswith("fairgate_upstream_step_drift_ratio{")]
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize(("replica", "expected"), [(SLOW, 3.0), (REPLICA, 1.0)])
def test_the_drift_of_the_cost_model_is_measured_and_logged(tmp_path, caplog, replica, expected):
    caplog.set_level(logging.INFO)
    settings = SLOW.settings("emu") if replica is SLOW else EMULATOR
    with serve_stack(tmp_path, upstream=create_app(settings), admin_key=ADMIN_KEY) as stack:
        reply = post(stack.url, stack.keys["alpha"], dict(BODY, max_tokens=150, stream=True))
        assert reply.status_code == 200
        ratio = _ratio(stack.url)
    drifted = [m for m in caplog.messages if '"cost_model_drift"' in m]
    # The emulator's steps on a loaded machine run a little late: the bound is one-sided above.
    assert expected * 0.85 <= ratio <= expected * 1.6, ratio
    assert len(drifted) == (1 if replica is SLOW else 0), drifted
    assert all('"emu-0"' in m for m in drifted)
