"""Review: LiveMeter against ReferenceMeter with wider strategies than test_meter.py (round and float
steps, several cost models, boundary lags, backward clocks, id reuse, first_token on pending/unknown ids)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fairgate.core import CostModel
from fairgate.core.meter import LiveMeter, Occupancy
from fairgate.core.meter_reference import ReferenceMeter

COSTS = [
    CostModel(9, 0.55, 0.06, 24),
    CostModel(9, 0, 0.06, 24),
    CostModel(9, 0.55, 0, 24),
    CostModel(1, 5, 1.0, 24),
    CostModel(30, 0.01, 0.001, 24),
    CostModel(1000, 0, 0.06, 24),
]
STEP = st.one_of(st.integers(-5, 60).map(float), st.floats(-5.0, 60.0), st.just(0.0), st.floats(0, 2000))
EVENT = st.tuples(
    st.sampled_from(["start", "start", "first", "token", "token", "finish", "tick", "remote", "occupancy"]),
    st.integers(0, 9),
    STEP,
    st.one_of(st.integers(0, 400), st.integers(0, 100_000)),
    st.integers(1, 4),
)


def same(a: float, b: float, abs_: float = 1e-6) -> bool:
    return abs(a - b) <= max(abs_, 1e-9 * max(abs(a), abs(b)))


@settings(max_examples=3000, deadline=None)
@given(st.sampled_from(COSTS), st.sampled_from([None, 0.0, 0.5, 1e6]), st.lists(EVENT, max_size=200))
def test_live_meter_agrees_with_the_reference_widely(cost, lag, events):
    meter, reference = LiveMeter(cost, 0.0, lag), ReferenceMeter(cost, 0.0, lag)
    now, live = 0.0, set()
    for kind, index, step, prompt, n in events:
        now += step
        rid = f"r{index}"
        if kind == "start" and rid not in live:
            meter.start(rid, "t", prompt, now, n), reference.start(rid, "t", prompt, now, n)
            live.add(rid)
        elif kind == "first":  # in flight or not, pending or not, twice or not
            meter.first_token(rid, now), reference.first_token(rid, now)
        elif kind == "finish" and rid in live:
            assert same(meter.finish(rid, now), reference.finish(rid, now)[1])
            live.discard(rid)
        elif kind == "remote":
            remote = Occupancy(float(n - 1) * abs(step) / 10.0, min(1.0, prompt / 8000.0))
            meter.set_remote(remote, now), reference.set_remote(remote, now)
        elif kind == "occupancy":
            taken, expected = meter.take_occupancy(), reference.take_occupancy()
            assert same(taken.sequences, expected.sequences, 1e-9)
            assert same(taken.prefill_share, expected.prefill_share, 1e-9)
        elif kind == "token":
            meter.token(now), reference.token(now)
        else:
            meter.advance(now), reference.advance(now)
        for r in live:
            assert same(meter.charged_ms(r), reference.charged_ms(r)), (r, kind)
        assert (meter.prefilling, meter.sequences, meter.in_flight) == (
            reference.prefilling,
            reference.sequences,
            reference.in_flight,
        )
        assert same(meter.busy_ms, reference.busy_ms) and same(meter.charged_total_ms, reference.charged_total_ms)


def test_an_interval_that_ends_exactly_where_a_prefill_ends():
    """Round numbers: b's prefill (3.9 ms) is attributed exactly at 24 ms (weights 5.05 + 8.95 = 14, 14 ms);
    the integral and the per-interval sum round to different sides of the end."""
    cost = CostModel(9, 0.55, 0.06, 24)
    meter, reference = LiveMeter(cost, 0.0), ReferenceMeter(cost, 0.0)
    for m in (meter, reference):
        m.start("a", "t", 0, 0.0)
        m.start("b", "t", 65, 0.0)  # pending beside a
        m.token(10.0)  # b joins
        m.token(24.0)
    assert meter.prefilling == reference.prefilling
    for m in (meter, reference):
        m.token(54.0)
    assert meter.charged_ms("b") == pytest.approx(reference.charged_ms("b"), rel=1e-9)


def test_a_long_busy_period_keeps_the_integral_precise():
    """A replica that never idles for a day: ~4e6 of price (22 ms of weight per unit) before these events."""
    import random

    cost, rng = CostModel(9, 0.55, 0.06, 24), random.Random(1)
    for _trial in range(20):
        meter, reference = LiveMeter(cost, 0.0), ReferenceMeter(cost, 0.0)
        meter._price = 4e6
        now, count, live = 0.0, 0, []
        for m in (meter, reference):
            m.start("keep", "t", 0, now)
        for _ in range(400):
            now += rng.uniform(5, 30)
            if len(live) < 20 and rng.random() < 0.3:
                count += 1
                live.append(f"r{count}")
                prompt = rng.randint(0, 2000)
                meter.start(live[-1], "t", prompt, now), reference.start(live[-1], "t", prompt, now)
            elif live and rng.random() < 0.1:
                rid = live.pop(rng.randrange(len(live)))
                assert meter.finish(rid, now) == pytest.approx(reference.finish(rid, now)[1], rel=1e-9, abs=0)
            else:
                meter.token(now), reference.token(now)
