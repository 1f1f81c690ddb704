import pytest

from fairgate.core import CostModel


def test_seed_exchange_rates():
    cost = CostModel(9, 0.55, 0.06, 24)
    assert round(cost.vtc_exchange_rate(24), 2) == 15.42
    assert round(cost.vtc_exchange_rate(8), 2) == 27.92
    assert round(cost.vtc_exchange_rate(48), 2) == 12.29


def test_iteration_time_and_charges_add_up():
    cost = CostModel(9, 0.55, 0.06, 24)
    assert cost.iteration_ms(24, 400) == pytest.approx(9 + 0.55 * 24 + 0.06 * 400)
    assert cost.decode_charge_ms(24) == pytest.approx((9 + 0.55 * 24) / 24)
    # B sequences each charged dt/B, plus the prefill of the new one, is the iteration's dt.
    charges = 24 * cost.decode_charge_ms(24) + cost.prefill_ms(400)
    assert charges == pytest.approx(cost.iteration_ms(24, 400), rel=1e-12)
    assert cost.decode_ns(24) == 22_200_000 and cost.prefill_ns(400) == 24_000_000


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"iter_base_ms": 0}, "iter_base_ms"),
        ({"iter_slope_ms": -1}, "iter_slope_ms"),
        ({"prefill_ms_per_token": -0.1}, "prefill_ms_per_token"),
        ({"max_batch": 0}, "max_batch"),
        ({"max_batch": 2.5}, "max_batch"),
    ],
)
def test_rejects_bad_parameters(kwargs, field):
    args = {"iter_base_ms": 9, "iter_slope_ms": 0.55, "prefill_ms_per_token": 0.06, "max_batch": 24} | kwargs
    with pytest.raises(ValueError, match=field):
        CostModel(**args)


def test_exchange_rate_needs_prefill_cost():
    with pytest.raises(ValueError, match="prefill_ms_per_token"):
        CostModel(9, 0.55, 0, 24).vtc_exchange_rate(24)
