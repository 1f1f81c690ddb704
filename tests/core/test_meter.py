"""The live meter splits wall time among requests in flight; the charges add up to the busy time."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fairgate.core import CostModel
from fairgate.core.meter import LiveMeter

COST = CostModel(9, 0.55, 0.06, 24)


def test_two_decoding_requests_split_evenly_and_prefill_weighs_more():
    meter = LiveMeter(COST, 0.0)
    meter.start("a", "ta", 400, 0.0)
    meter.first_token("a", 30.0)  # alone: all 30 ms are a's
    assert meter.charged_ms("a") == pytest.approx(30.0)
    meter.start("b", "tb", 400, 30.0)
    # a's iteration is still running: b waits for its boundary and is charged nothing meanwhile.
    assert [(c.request_id, c.gpu_ms) for c in meter.token(40.0)] == [("a", pytest.approx(10.0))]
    charges = meter.advance(50.0)  # b prefilling in the next iteration: it weighs more than a
    by_id = {c.request_id: c.gpu_ms for c in charges}
    assert sum(by_id.values()) == pytest.approx(10.0) and by_id["b"] > by_id["a"]
    meter.first_token("b", 50.0)
    charges = meter.advance(70.0)
    assert [c.gpu_ms for c in charges] == pytest.approx([10.0, 10.0])  # both decoding: dt / B each


def test_idle_time_is_not_charged_and_backwards_clock_charges_nothing():
    meter = LiveMeter(COST, 0.0)
    meter.start("a", "t", 10, 100.0)  # idle before: not busy
    _, total = meter.finish("a", 110.0)
    assert total == pytest.approx(10.0) and meter.busy_ms == pytest.approx(10.0)
    meter.start("b", "t", 10, 200.0)
    assert meter.advance(150.0) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["start", "first", "token", "finish", "tick"]), st.integers(0, 5),
                          st.floats(0.0, 50.0), st.integers(0, 3000)), max_size=60))
def test_charges_sum_to_busy_time(events):
    meter = LiveMeter(COST, 0.0)
    now, charged, live, first_seen = 0.0, 0.0, set(), set()
    finished_totals = 0.0
    for kind, index, step, prompt in events:
        now += step
        rid = f"r{index}"
        if kind == "start" and rid not in live:
            charged += sum(c.gpu_ms for c in meter.start(rid, f"t{index % 2}", prompt, now))
            live.add(rid)
        elif kind == "first" and rid in live:
            charged += sum(c.gpu_ms for c in meter.first_token(rid, now))
        elif kind == "token":
            charged += sum(c.gpu_ms for c in meter.token(now))
        elif kind == "finish" and rid in live:
            charges, total = meter.finish(rid, now)
            charged += sum(c.gpu_ms for c in charges)
            finished_totals += total
            live.discard(rid)
        else:
            charged += sum(c.gpu_ms for c in meter.advance(now))
    assert charged == pytest.approx(meter.busy_ms, rel=1e-9, abs=1e-9)
    in_flight = sum(meter.charged_ms(r) for r in live)
    assert finished_totals + in_flight == pytest.approx(meter.busy_ms, rel=1e-9, abs=1e-9)
    assert all(c >= 0 for c in [finished_totals, in_flight])


def test_a_request_sent_mid_iteration_is_charged_only_from_the_next_boundary():
    meter = LiveMeter(COST, 0.0)
    meter.start("long", "a", 2000, 0.0)  # alone: prefilled at once, 2000 x 0.06 = 120 ms of prefill
    meter.start("late", "b", 2000, 10.0)  # sent during long's prefill iteration: pending
    charges = meter.first_token("long", 130.0)
    assert [(c.request_id, c.gpu_ms) for c in charges] == [("long", pytest.approx(120.0))]
    assert meter.charged_ms("late") == 0.0
    meter.advance(260.0)  # late's prefill iteration: it carries the prefill weight
    assert meter.charged_ms("late") > 100.0
