"""Fairness live: four tenants with seed 002's output mix keep their queues full through the gateway,
against two emulated replicas, with the ``openai`` client (bench/live_fairness.py, shorter run)."""

from __future__ import annotations

from bench.live_fairness import MIX, run


def test_gpu_fair_shares_are_equal_through_the_gateway():
    shares, done = run("gpu_fair", seconds=30.0, clients=48)
    assert all(done[t] > 0 for t in MIX)
    assert done["classify"] > 3 * done["agent"]  # very different request counts...
    assert max(shares.values()) / min(shares.values()) <= 1.05  # ...the same GPU time
