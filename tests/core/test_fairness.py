import pytest

from fairgate.core import gpu_shares, jain_index, max_min_ratio, weighted


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
