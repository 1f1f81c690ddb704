"""The cost model's drift check (fairgate.core.drift): observed decode steps against predicted ones."""

from __future__ import annotations

import random

import pytest

from fairgate.core.cost import CostModel
from fairgate.core.drift import StepDrift

COST = CostModel(iter_base_ms=10.0, iter_slope_ms=1.0, prefill_ms_per_token=0.1, max_batch=8)


def iteration(drift: StepDrift, gap_ms: float, batch: int) -> list[bool | None]:
    """The ``batch`` observations of one iteration of ``gap_ms`` (each running request sees the step)."""
    return [drift.observe(gap_ms, batch) for _ in range(batch)]


def iterations(drift: StepDrift, gap_ms: float, batch: int, count: int) -> list[bool | None]:
    return [event for _ in range(count) for event in iteration(drift, gap_ms, batch)]


def test_steps_as_predicted_report_a_ratio_of_one_and_no_drift():
    drift = StepDrift(COST, min_steps=10)
    events = [e for b in (1, 4, 8) * 10 for e in iteration(drift, 10.0 + 1.0 * b, b)]
    assert drift.ratio == pytest.approx(1.0)
    assert set(events) == {None} and not drift.drifted


def test_steps_twice_as_slow_drift_once_and_come_back_once():
    drift = StepDrift(COST, alpha=0.1, min_steps=10)
    assert drift.ratio is None and set(iteration(drift, 36.0, 8)) == {None}  # too few iterations to say
    crossed = iterations(drift, 36.0, 8, 30)  # predicted 18 ms at B = 8
    assert crossed.count(True) == 1 and crossed.count(False) == 0
    assert drift.ratio == pytest.approx(2.0)
    back = iterations(drift, 18.0, 8, 100)
    assert back.count(False) == 1 and back.count(True) == 0
    assert drift.ratio == pytest.approx(1.0, rel=0.01)


def test_a_stall_is_no_step():
    drift = StepDrift(COST, min_steps=1)
    assert drift.observe(11.0, 1) is None
    assert drift.observe(5 * 11.0, 1) is None and drift.observe(0.0, 1) is None  # ignored
    assert drift.steps == 1 and drift.ratio == pytest.approx(1.0)


def test_a_ratio_hovering_at_the_band_edge_drifts_once():
    """An emulator on a loaded machine sat at 1.25 +- 0.01 and logged a drift and its end again and again; it
    comes back only within half the band."""
    drift = StepDrift(COST, alpha=0.5, min_steps=1)  # a fast mean, to cross the edge at every other step
    crossed = [e for i in range(200) for e in iteration(drift, 18.0 * (1.25 + (0.01 if i % 2 else -0.01)), 8)]
    assert crossed.count(True) == 1 and crossed.count(False) == 0 and drift.drifted
    back = iterations(drift, 18.0 * 1.15, 8, 50)  # inside the band, outside its half: still drifted
    assert set(back) == {None} and drift.drifted
    assert iterations(drift, 18.0, 8, 50).count(False) == 1 and not drift.drifted


def test_a_large_batch_averages_over_iterations_not_over_its_requests():
    """The demo at B = 48 on a loaded machine: each iteration 1.26x its prediction give or take 10 %, seen by
    all 48 requests. Weighed one per observation, the mean followed each iteration across the band's edge and
    half of it (a drift warning every half second); weighed 1/B, it is one drift."""
    rng = random.Random(7)
    drift = StepDrift(COST)
    predicted = COST.iter_base_ms + COST.iter_slope_ms * 48
    crossed = [e for _ in range(2000) for e in iteration(drift, predicted * rng.gauss(1.26, 0.13), 48)]
    assert crossed.count(True) == 1 and crossed.count(False) == 0
    assert drift.ratio == pytest.approx(1.26, rel=0.05)


def test_a_gap_begun_with_the_relay_held_half_a_step_or_more_is_no_step():
    drift = StepDrift(COST, min_steps=1)
    predicted_ms = COST.iter_base_ms + COST.iter_slope_ms  # 11 ms at B = 1
    assert drift.observe(16.5, 1, held_ms=0.5 * predicted_ms) is None
    assert drift.steps == 0 and drift.ratio is None
    drift.observe(16.5, 1, held_ms=0.49 * predicted_ms)
    assert drift.steps == 1 and drift.ratio == pytest.approx(1.5)
