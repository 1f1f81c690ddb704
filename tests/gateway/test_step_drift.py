"""The drift check through a real gateway: a replica three times slower than the cost model the gateway
was given shows ``fairgate_upstream_step_drift_ratio`` near 3 on /metrics and one ``cost_model_drift``
warning naming the upstream; one that matches it shows a ratio near 1 and no warning."""

from __future__ import annotations

import logging

import httpx
import pytest

from fairgate.emulator.api import create_app
from tests.gateway.conftest import BODY, post, serve_stack, slower

SLOW = slower(3.0)
# A replica the cost model describes, with steps long enough (~17 ms) that a loaded machine's lateness
# (1-2 ms a step, measured on two busy cores) stays well inside the drift band (25 %).
MATCHING = slower(4.0)


ADMIN_KEY = "fg-test-admin-" + "d" * 24


def _ratio(url: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10).text
    [line] = [x for x in text.splitlines() if x.startswith("fairgate_upstream_step_drift_ratio{")]
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize(("replica", "expected"), [(SLOW, 3.0), (MATCHING, 1.0)])
def test_the_drift_of_the_cost_model_is_measured_and_logged(tmp_path, caplog, replica, expected):
    caplog.set_level(logging.INFO)
    # The gateway is given REPLICA's cost model, or MATCHING's for MATCHING's replica.
    cost = {} if replica is SLOW else {k: getattr(MATCHING, k) for k in ("iter_base_ms", "iter_slope_ms")}
    with serve_stack(
        tmp_path, upstream=create_app(replica.settings("emu")), admin_key=ADMIN_KEY, upstream_table=cost
    ) as stack:
        reply = post(stack.url, stack.keys["alpha"], dict(BODY, max_tokens=150, stream=True))
        assert reply.status_code == 200
        ratio = _ratio(stack.url)
    drifted = [m for m in caplog.messages if '"cost_model_drift"' in m]
    # The emulator's steps on a loaded machine run a little late: the bound is one-sided above.
    assert expected * 0.85 <= ratio <= expected * 1.6, ratio
    assert len(drifted) == (1 if replica is SLOW else 0), drifted
    assert all('"emu-0"' in m for m in drifted)
