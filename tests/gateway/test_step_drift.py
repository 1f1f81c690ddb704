"""The drift check through a real gateway: a replica three times slower than the cost model the gateway
was given shows ``fairgate_upstream_step_drift_ratio`` near 3 on /metrics and one ``cost_model_drift``
warning naming the upstream; one that matches it shows a ratio near 1 and no warning."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from fairgate.core.cost import CostModel
from fairgate.core.meter import DECODE_SCALE_RANGE
from fairgate.emulator.api import create_app
from fairgate.gateway.dispatch import Upstream
from fairgate.gateway.upstream import CallState, UpstreamClient
from fairgate.harness.threads import serve_in_thread
from tests.gateway.conftest import BODY, REPLICA, post, serve_stack, slower

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


async def _stream_once(url: str) -> tuple[float | None, float]:
    """One stream of 150 tokens through an ``UpstreamClient`` given ``REPLICA``'s cost model: the drift ratio
    and the meter's decode scale after it."""
    cost = CostModel(REPLICA.iter_base_ms, REPLICA.iter_slope_ms, REPLICA.prefill_ms_per_token, REPLICA.max_batch)
    client = UpstreamClient(Upstream("emu-0", "emu", f"{url}/v1", REPLICA.max_batch, cost), lambda *args: None)
    async for _ in client.stream("/completions", dict(BODY, max_tokens=150), CallState("r", "alpha", 1), 0.0):
        pass
    await client.close()
    return client.drift.ratio, client.meter.decode_scale


def test_the_meters_decode_step_follows_the_drift_ratio():
    """On a replica three times slower than its cost model, the meter weighs a decode step by the observed
    one (``LiveMeter.set_decode_scale``), up to twice the model's: what the decoding sequences of an iteration
    that also prefills are charged by."""
    with serve_in_thread(create_app(SLOW.settings("emu"))) as url:
        ratio, scale = asyncio.run(_stream_once(url))
    assert ratio is not None and 3.0 * 0.85 <= ratio <= 3.0 * 1.6, ratio
    low, high = DECODE_SCALE_RANGE  # a model off by more than that is reported, no longer corrected
    assert scale == pytest.approx(min(high, max(low, ratio)), rel=0.021)


async def _stream_held(url: str, holds_s: tuple[float, ...]) -> tuple[float | None, float, int]:
    """One stream of 120 tokens from a replica its cost model describes (``MATCHING``), whose reader holds the
    i-th chunk ``holds_s[i % len(holds_s)]`` before asking for the next (a client whose writes block): the
    drift ratio, the meter's decode scale and the steps the drift check took."""
    cost = CostModel(MATCHING.iter_base_ms, MATCHING.iter_slope_ms, MATCHING.prefill_ms_per_token, MATCHING.max_batch)
    client = UpstreamClient(Upstream("emu-0", "emu", f"{url}/v1", MATCHING.max_batch, cost), lambda *args: None)
    client.drift.min_steps = 10
    stream = client.stream("/completions", dict(BODY, max_tokens=120), CallState("r", "alpha", 1), 0.0)
    i = 0
    async for _ in stream:
        await asyncio.sleep(holds_s[i % len(holds_s)])
        i += 1
    await client.close()
    return client.drift.ratio, client.meter.decode_scale, client.drift.steps


STEP_S = (MATCHING.iter_base_ms + MATCHING.iter_slope_ms) / 1000.0  # one step at B = 1


@pytest.mark.serial  # its quick stream's gaps are the engine's steps only on a machine nothing else loads
@pytest.mark.parametrize(
    "holds_s",
    [(1.5 * STEP_S,), (1.4 * STEP_S, 0.0)],
    ids=["every-token-held-1.5-steps", "every-other-token-held-1.4-steps"],
)
def test_a_client_that_reads_slowly_moves_neither_the_drift_ratio_nor_the_decode_scale(holds_s):
    """Held 1.5 steps each, every other gap is 1.5 steps long, one token a read (the tokens between come two
    to a read and are no step); held 1.4 steps every other token, the gap after the hold reads 1.4 steps and
    the one after it, begun by that late read, 0.6. Such gaps time the client, not the engine, and would move
    money between tenants through the decode scale: a gap either end of which the relay was held half a
    predicted step or more is no sample. Held 1 ms, the gaps are the engine's steps and are sampled."""
    with serve_in_thread(create_app(MATCHING.settings("emu"))) as url:
        ratio, scale, steps = asyncio.run(_stream_held(url, holds_s))
        quick_ratio, _, quick_steps = asyncio.run(_stream_held(url, (0.001,)))
    assert steps == 0 and ratio is None and scale == 1.0, (steps, ratio, scale)
    assert quick_steps >= 60 and quick_ratio is not None and 0.85 <= quick_ratio <= 1.25, (quick_steps, quick_ratio)
