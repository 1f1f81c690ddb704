import pytest

from fairgate.core import gpu_shares, jain_index, max_min_ratio, weighted
from fairgate.core.fairness import RequestSpans, ServiceDifference, service_difference


def test_shares_ratio_and_jain():
    shares = gpu_shares({"a": 30.0, "b": 10.0}, 40.0)
    assert shares == {"a": 0.75, "b": 0.25}
    assert max_min_ratio(shares) == 3.0
    assert jain_index(shares) == pytest.approx(1.0 / (2 * (0.75**2 + 0.25**2)))
    assert jain_index({"a": 1, "b": 1, "c": 1}) == 1.0


def test_weights_normalise_shares():
    fair = weighted({"a": 2 / 3, "b": 1 / 3}, {"a": 2.0})
    assert max_min_ratio(fair) == pytest.approx(1.0)


def test_zero_share_is_infinitely_unfair():
    assert max_min_ratio({"a": 0.0, "b": 1.0}) == float("inf")
    with pytest.raises(ValueError):
        gpu_shares({"a": 1.0}, 0.0)


def _spans(*rows: tuple[int, float, float, float, int, int]) -> RequestSpans:
    spans = RequestSpans()
    for row in rows:
        spans.add(*row)
    return spans


def test_service_difference_counts_the_gap_to_the_best_served_tenant():
    # Window [-5, 5] s around the one point x = 0. Tenant 0: service 2 + 2*4 = 10, all inside: s0 = 1/s, r0 = 1/s.
    # Tenant 1: service 2*10 = 20 spread over 20 s, 5 s inside: s1 = 0.5/s; demand r1 = 20/10 = 2/s.
    spans = _spans((0, 0.0, 0.0, 4.0, 2, 4), (1, 0.0, 0.0, 20.0, 0, 10))
    diff = service_difference(spans, 2, window_s=10.0, points=1)
    assert (diff.max_per_s, diff.avg_per_s, diff.points) == (pytest.approx(0.5), pytest.approx(0.5), 1)


def test_service_difference_counts_a_gap_only_as_far_as_the_tenant_asked():
    # Tenant 1 asked for 0.2/s (one request of service 2 * 1 output token = 2, in the 10-s window) and got
    # 0.05/s (that service spread over 20 s, 5 s inside): its gap to tenant 0's 1/s is capped at its unmet
    # demand, 0.15/s.
    spans = _spans((0, 0.0, 0.0, 4.0, 2, 4), (1, 0.0, 0.0, 20.0, 0, 1))
    diff = service_difference(spans, 2, window_s=10.0, points=1)
    assert diff.max_per_s == pytest.approx(0.2 - 0.05)


def test_service_difference_averages_over_points_and_divides_by_weights():
    # Two points, x = 0 and x = 10 (arrivals up to 20 s). At x = 10 (window [5, 15]) only tenant 1's second
    # request is served: 2*10 = 20 over [10, 20], 5 s inside: s1 = 0.5; r1 = 20/10 = 2; s0 = r0 = 0 -> the
    # gap is tenant 0's min(0.5, 0) = 0 plus tenant 1's min(0, 1.5) = 0.
    spans = _spans((0, 0.0, 0.0, 4.0, 2, 4), (1, 0.0, 0.0, 20.0, 0, 10), (1, 10.0, 10.0, 20.0, 0, 10))
    plain = service_difference(spans, 2, window_s=10.0, points=2)
    # At x = 0 tenant 1's second request is outside: as in the first test, 0.5.
    assert (plain.max_per_s, plain.avg_per_s, plain.points) == (pytest.approx(0.5), pytest.approx(0.25), 2)
    # Weight 2 on tenant 1 halves its rates: at x = 0, s1 = 0.25, r1 = 1 -> gap min(0.75, 0.75) = 0.75.
    weighted_diff = service_difference(spans, 2, window_s=10.0, points=2, tenant_weights=[1.0, 2.0])
    assert weighted_diff.max_per_s == pytest.approx(0.75)


def test_service_difference_ignores_unfinished_and_instant_requests_and_rejects_bad_arguments():
    nan = float("nan")
    spans = _spans((0, 0.0, nan, nan, 5, 5), (1, 0.0, 1.0, 1.0, 5, 1))
    assert service_difference(spans, 2) == ServiceDifference(0.0, 0.0, 0)
    with pytest.raises(ValueError, match="window_s"):
        service_difference(spans, 2, window_s=0.0)
    with pytest.raises(ValueError, match="tenant_weights"):
        service_difference(spans, 2, tenant_weights=[1.0])
    broken = _spans((0, 0.0, 0.0, 1.0, 1, 1))
    broken.tenant.append(1)
    with pytest.raises(ValueError, match="length"):
        service_difference(broken, 2)
