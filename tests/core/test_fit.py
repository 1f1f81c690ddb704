"""The calibration fits (fairgate.core.fit): lines through exact and noisy probes, and the decode step
read from token arrivals."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fairgate.core.fit import fit_line, median, steady_step_ms


@given(st.floats(0.1, 100.0), st.floats(0.0, 10.0), st.lists(st.integers(1, 256), min_size=2, max_size=12, unique=True))
def test_a_line_through_exact_points_is_recovered_with_no_error(intercept, slope, xs):
    line = fit_line([(x, intercept + slope * x) for x in xs])
    assert line.intercept == pytest.approx(intercept, rel=1e-6, abs=1e-6)
    assert line.slope == pytest.approx(slope, rel=1e-6, abs=1e-6)
    assert line.slope_se == pytest.approx(0.0, abs=1e-5)
    assert line.max_rel_residual == pytest.approx(0.0, abs=1e-6)


def test_noisy_points_give_the_textbook_standard_errors():
    # y = 10 + 2x with residuals +1, -1, -1, +1 at x = 1..4: s^2 = 4 / 2, Sxx = 5.
    line = fit_line([(1, 13.0), (2, 13.0), (3, 15.0), (4, 19.0)])
    assert (line.intercept, line.slope) == pytest.approx((10.0, 2.0))
    assert line.slope_se == pytest.approx((2.0 / 5.0) ** 0.5)
    assert line.intercept_se == pytest.approx((2.0 * (1 / 4 + 2.5**2 / 5)) ** 0.5)


def test_a_line_needs_two_distinct_x():
    with pytest.raises(ValueError, match="two different x"):
        fit_line([(4, 1.0), (4, 2.0)])
    with pytest.raises(ValueError, match="nothing"):
        median([])


def test_the_steady_step_counts_only_the_gaps_while_every_stream_decodes():
    # Stream a starts at 0 and runs alone for two slow steps (50 ms), then b joins at 0.1 s: 20 ms steps
    # while both decode, until a ends at 0.2 s; b's tail after that does not count either.
    a = [0.0, 0.05, 0.1, 0.12, 0.14, 0.16, 0.18, 0.2]
    b = [0.1, 0.12, 0.14, 0.16, 0.18, 0.2, 0.3, 0.4]
    assert steady_step_ms([a, b]) == pytest.approx(20.0)
    assert steady_step_ms([[0.0]]) is None
