"""The rolling aggregator on a fake clock: window sums and expiry, shares, max/min and Jain's index over
weighted shares, percentiles, gaps, busy fraction, and the bounded sample series."""

from __future__ import annotations

import pytest

from fairgate.core.fairness import RequestSpans, jain_index, max_min_ratio, service_gap
from fairgate.gateway.observe import Admitted, Charged, Dispatched, Finished, Rejected
from fairgate.gateway.stats import Probe, Stats, UpstreamProbe, p99
from tests.gateway.conftest import Clock


def finished(
    tenant: str,
    time_s: float,
    *,
    gpu_ms: float = 10.0,
    estimate: float = 15.0,
    output: int = 4,
    max_output: int = 8,
    ttft_ms: float | None = 20.0,
    tpot_ms: float | None = 5.0,
    upstream: str = "u0",
    model: str = "m",
    outcome: str = "completed",
) -> Finished:
    return Finished(
        "r", tenant, model, upstream, outcome, 1.0, ttft_ms, tpot_ms, 3, output, gpu_ms, estimate, max_output, time_s
    )


def test_shares_max_min_and_jain_over_the_window():
    clock = Clock()
    stats = Stats(clock=clock, weights={"b": 2.0})
    for tenant, ms in (("a", 100.0), ("b", 300.0), ("c", 100.0)):
        stats.observe(Charged(tenant, "m", ms / 2, clock.now - 10))
        stats.observe(Charged(tenant, "m", ms / 2, clock.now - 1))
    pool = stats.window().pools["m"]
    assert pool.gpu_ms == {"a": 100.0, "b": 300.0, "c": 100.0}
    assert pool.shares == pytest.approx({"a": 0.2, "b": 0.6, "c": 0.2})
    assert (pool.max_share, pool.min_share) == pytest.approx((0.6, 0.2))
    # Weighted shares: a 0.2, b 0.6 / 2 = 0.3, c 0.2.
    assert pool.max_min == pytest.approx(1.5)
    assert pool.jain == pytest.approx(jain_index({"a": 0.2, "b": 0.3, "c": 0.2}))
    assert pool.jain == pytest.approx(0.49 / (3 * 0.17))
    assert stats.window().tenants["b"].gpu_share == pytest.approx(0.6)


def test_charges_leave_the_window_and_idle_tenants_are_not_compared():
    clock = Clock(0.0)
    stats = Stats(clock=clock, window_s=60.0)
    stats.observe(Charged("a", "m", 500.0, 0.2))
    stats.observe(Charged("b", "m", 100.0, 30.5))
    clock.now = 59.0
    assert stats.window().pools["m"].gpu_ms == {"a": 500.0, "b": 100.0}
    assert stats.window().pools["m"].max_min == pytest.approx(5.0)
    clock.now = 61.0  # a's second [0, 1) has left the window [1, 61]
    pool = stats.window().pools["m"]
    assert pool.gpu_ms == {"b": 100.0} and pool.shares == {"b": 1.0}
    assert (pool.max_min, pool.jain) == (1.0, 1.0)
    clock.now = 91.0
    assert stats.window().pools == {}  # no charge in the window and no upstream (no probe) serving "m"
    serving = Stats(lambda: Probe(upstreams=[UpstreamProbe("u0", "m", 0, 4, 0.0)]), clock=clock)
    pool = serving.window().pools["m"]
    assert pool.gpu_ms == {} and pool.max_min is None and pool.jain is None and pool.max_share is None
    # Cumulative totals never expire.
    assert stats.totals["a"].gpu_ms == 500.0 and stats.totals["b"].gpu_ms == 100.0


def test_pools_are_per_model_and_figures_match_the_core():
    clock = Clock()
    stats = Stats(clock=clock)
    for tenant, model, ms in (("a", "m1", 40.0), ("b", "m1", 10.0), ("a", "m2", 5.0), ("c", "m2", 5.0)):
        stats.observe(Charged(tenant, model, ms, clock.now))
    view = stats.window()
    assert view.pools["m1"].max_min == pytest.approx(max_min_ratio({"a": 0.8, "b": 0.2})) == pytest.approx(4.0)
    assert view.pools["m2"].max_min == pytest.approx(1.0)
    assert view.tenants["a"].gpu_ms == 45.0 and view.tenants["a"].gpu_share == pytest.approx(45 / 60)


def test_counts_tokens_gaps_and_percentiles():
    clock = Clock(101.0)
    stats = Stats(clock=clock, sample_every_s=1e9)
    stats.observe(Admitted("r1", "a", None, "m", "res", 3, 8, 15.0, 99.0))
    stats.observe(Admitted("r2", "a", None, "m", "res", 3, 8, 15.0, 99.0))
    stats.observe(Rejected("r3", "a", "m", "rate", 429, "x", 99.0))
    stats.observe(Rejected("r4", "a", "m", "queue_full", 429, "x", 99.0, after_admission=True))
    stats.observe(Rejected("r5", None, None, "auth", 401, "x", 99.0))
    for i in range(100):
        stats.observe(Dispatched(f"d{i}", "a", "m", "u0", float(i + 1), 99.0))
    stats.observe(finished("a", 99.0, gpu_ms=10.0, estimate=15.0, output=4, max_output=8, ttft_ms=20.0))
    stats.observe(finished("a", 100.5, gpu_ms=30.0, estimate=15.0, output=8, max_output=8, ttft_ms=200.0))
    w = stats.window().tenants["a"]
    assert (w.admissions, w.rejections, w.rejected) == (2, {"rate": 1, "queue_full": 1}, 2)
    assert (w.input_tokens, w.output_tokens) == (6, 12)
    assert w.queue_p99_ms == 99.0  # nearest rank of 1..100
    assert w.ttft_p99_ms == 201.0  # what the client waited: 1 ms queued + 200 ms to the first token
    assert w.reserve_gap_gpu_ms == pytest.approx((15 - 10) + (15 - 30))
    assert w.reserve_gap_output_tokens == 4
    totals = stats.totals["a"]
    assert totals.overage_gpu_ms == 15.0 and totals.billed.gpu_ms == 40.0 and totals.reserved_gpu_ms == 30.0
    assert totals.reserved_output_tokens == 16 and totals.finished == {"completed": 2}
    assert stats.unattributed_rejections == {"auth": 1}
    assert stats.window().pools == {}  # no GPU time charged, no upstream
    # Counts are summed in 1-s buckets: at 160.2 the window [100.2, 160.2] keeps the bucket [100, 101) of the
    # second finish (t=100.5) and drops [99, 100), which held everything else.
    clock.now = 160.2
    w = stats.window().tenants["a"]
    assert (w.admissions, w.output_tokens, w.ttft_p99_ms, w.queue_p99_ms) == (0, 8, 201.0, None)


def test_p99_nearest_rank():
    assert p99([]) is None
    assert p99([5.0]) == 5.0
    assert p99(float(i) for i in range(1, 201)) == 198.0


def test_busy_fraction_and_iterations_from_the_probe():
    clock = Clock(0.0)
    busy = {"u0": 0.0}
    running = {"a": 0}

    def probe() -> Probe:
        return Probe(
            running=dict(running), queued={"b": 2}, upstreams=[UpstreamProbe("u0", "m", running["a"], 4, busy["u0"])]
        )

    stats = Stats(probe, clock=clock, sample_every_s=2.0)
    stats.tick()  # the first sample: the busy reference
    assert stats.samples[-1].busy == {"u0": None}
    clock.now, busy["u0"], running["a"] = 10.0, 2500.0, 3
    stats.observe(finished("a", 9.0, tpot_ms=20.0))
    stats.observe(finished("a", 9.0, tpot_ms=30.0))
    [up] = stats.window().upstreams
    assert up.busy_fraction == pytest.approx(0.25)
    assert up.iterations_per_s == pytest.approx(0.25 * 1000 / 25.0)
    assert (up.in_flight, up.max_batch) == (3, 4)
    view = stats.window()
    assert (view.tenants["a"].running, view.tenants["b"].queued) == (3, 2)
    # A tenant that only waits in a queue is listed (running/queued) but not compared for shares.
    assert view.pools["m"].shares == {}


def test_samples_are_lazy_periodic_and_bounded():
    clock = Clock(0.0)
    stats = Stats(clock=clock, sample_every_s=2.0, max_samples=5)
    stats.observe(Admitted("r", "a", None, "m", "res", 3, 8, 15.0, 0.0))  # first event: first sample
    assert len(stats.samples) == 1
    clock.now = 1.0
    stats.observe(Admitted("r", "a", None, "m", "res", 3, 8, 15.0, 1.0))
    assert len(stats.samples) == 1  # not due yet
    clock.now = 2.0
    for _ in range(3):
        stats.observe(Charged("a", "m", 100.0, 2.0))  # the per-token path never samples
    assert len(stats.samples) == 1
    stats.tick()
    assert len(stats.samples) == 2
    point = stats.samples[-1].tenants["a"]
    assert point.admissions_per_s == pytest.approx(1 / 2.0)  # one admission since the sample at t=0
    assert point.gpu_s == pytest.approx(0.3) and point.gpu_share == 1.0
    for step in range(10):
        clock.now = 4.0 + 2 * step
        stats.tick()
    assert len(stats.samples) == 5 and stats.samples[-1].t_s == 22.0 and stats.samples[0].t_s == 14.0


def test_a_clock_step_backwards_is_booked_in_the_newest_bucket():
    clock = Clock(100.0)
    stats = Stats(clock=clock)
    stats.observe(Charged("a", "m", 1.0, 100.5))
    stats.observe(Charged("a", "m", 2.0, 99.2))
    assert stats.window().pools["m"].gpu_ms == {"a": 3.0}


def test_bad_parameters():
    with pytest.raises(ValueError):
        Stats(window_s=0)


def test_the_vtc_service_difference_is_over_the_requests_finished_in_the_window():
    clock = Clock()
    stats = Stats(clock=clock, window_s=10.0, weights={"b": 2.0})
    now = clock.now
    # a: 3 prompt + 4 output tokens; its first token 3 tpot of 1 s before its finish at now - 1, after 1 s
    # queued and 1 s to the first token: it arrived at now - 6 and was served over [now - 4, now - 1].
    stats.observe(Finished("a-1", "a", "m", "u0", "completed", 1000.0, 1000.0, 1000.0, 3, 4, 1.0, 1.0, 4, now - 1))
    # b: 3 + 20 tokens, served over [now - 21, now - 2], arrived at now - 27 (before the window).
    stats.observe(Finished("b-1", "b", "m", "u0", "completed", 5000.0, 1000.0, 1000.0, 3, 20, 1.0, 1.0, 20, now - 2))
    expected = RequestSpans()
    expected.add(0, now - 6, now - 4, now - 1, 3, 4)
    expected.add(1, now - 27, now - 21, now - 2, 3, 20)
    want = service_gap(expected, 2, now - 10, now, tenant_weights=[1.0, 2.0])
    # By hand: a's service 11 all in the window (1.1/s, demand 1.1/s); b's 43 / 2 (its weight) over 19 s, 8 s
    # in the window (0.905/s, no demand in it): a's gap 0, b's min(1.1 - 0.905, 0.905) = 0.195.
    assert want == pytest.approx(1.1 - 21.5 * 8 / 19 / 10)
    stats.observe(Charged("a", "m", 1.0, now - 1))  # (a pool is shown while it has charges in the window)
    assert stats.window().pools["m"].service_diff_per_s == pytest.approx(want)
    clock.now += 10.0  # both finished before the window: nothing to compare
    stats.observe(Charged("a", "m", 1.0, clock.now))
    assert stats.window().pools["m"].service_diff_per_s is None
