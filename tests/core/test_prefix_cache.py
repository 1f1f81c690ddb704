"""The prefix-cache credit (``fairgate.core.prefix_cache``): what a cached prompt prefix takes off a request's
charge, and who ran beside it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fairgate.core.cost import CostModel
from fairgate.core.meter import LiveMeter, MeteredCall
from fairgate.core.prefix_cache import cached_fraction, prefix_cache_credit

COST = CostModel(iter_base_ms=20.0, iter_slope_ms=1.0, prefill_ms_per_token=0.1, max_batch=8)


def _metered(sized_tokens: int, uncached: int) -> MeteredCall:
    """Tenant ``b`` decodes alone on an upstream; ``a``'s request, which the meter sizes at ``sized_tokens``,
    is sent 5 ms into one of its iterations, joins the next, where the engine prefills ``uncached`` tokens
    (the cost model's time), then both decode 5 iterations. What the meter charged ``a``."""
    meter, now = LiveMeter(COST, 0.0), 0.0
    meter.start("b", "b", 10, now)
    now += COST.iteration_ms(1, 10)
    meter.first_token("b", now)
    meter.start("a", "a", sized_tokens, now + 5.0)
    now += COST.iteration_ms(1)
    meter.token(now)  # b's token: the iteration ``a`` was sent in ended, ``a`` joins the next
    now += COST.iteration_ms(2, uncached)  # the engine prefills only what it did not cache
    meter.first_token("a", now)
    meter.token(now)
    for _ in range(5):
        now += COST.iteration_ms(2)
        meter.token(now)
    return meter.leave("a", now)


def _prefill_beside(prompt_tokens: int, cached_tokens: int) -> tuple[MeteredCall, float]:
    """``_metered`` sized by the whole prompt, and its charge on the same token timeline sized by the uncached
    prompt (what it would have been, had the meter known)."""
    uncached = prompt_tokens - cached_tokens
    return _metered(prompt_tokens, uncached), _metered(uncached, uncached).charged_ms


@pytest.mark.parametrize(("prompt_tokens", "cached_tokens"), [(1000, 0), (1000, 500), (1000, 992), (64, 48)])
def test_the_credit_is_what_the_meter_would_not_have_charged_had_it_sized_the_prefill_by_the_uncached_prompt(
    prompt_tokens, cached_tokens
):
    call, right_ms = _prefill_beside(prompt_tokens, cached_tokens)
    credit_ms, moves = prefix_cache_credit(call, 1 - cached_fraction(cached_tokens, prompt_tokens))
    assert call.charged_ms - credit_ms == pytest.approx(right_ms, rel=1e-9)
    # What it is credited goes to the tenant beside it: the iterations' time is all still charged.
    assert moves == ({"b": pytest.approx(credit_ms)} if cached_tokens else {})
    assert (credit_ms > 0) == (cached_tokens > 0)


def test_a_request_that_ran_alone_keeps_its_charge_whatever_was_cached():
    meter = LiveMeter(COST, 0.0)
    meter.start("a", "a", 1000, 0.0)
    meter.first_token("a", COST.iteration_ms(1, 8))
    call = meter.leave("a", 100.0)
    assert call.prefill_charged_ms > 0 and call.beside == {}
    assert prefix_cache_credit(call, 0.01) == (0.0, {})  # all the busy time was its own either way


def test_a_request_cut_while_pending_was_never_prefilled_by_the_meter():
    meter = LiveMeter(COST, 0.0)
    meter.start("b", "b", 10, 0.0)
    meter.first_token("b", 21.0)
    meter.start("a", "a", 1000, 25.0)  # sent mid-iteration: pending until the next boundary
    call = meter.leave("a", 30.0)
    assert call == MeteredCall(0.0, tenant="a")
    assert prefix_cache_credit(call, 0.5) == (0.0, {})


@pytest.mark.parametrize(
    ("cached", "prompt", "fraction"),
    [(0, 100, 0.0), (50, 100, 0.5), (100, 100, 1.0), (101, 100, None), (-1, 100, None), (True, 100, None),
     (50.0, 100, None), ("50", 100, None), (None, 100, None), (5, 0, None)],
)  # fmt: skip
def test_an_engines_cached_count_is_believed_only_as_a_whole_number_within_the_prompt(cached, prompt, fraction):
    assert cached_fraction(cached, prompt) == fraction


weights = st.floats(min_value=0.0, max_value=1e4, allow_nan=False)


@given(
    prefill=st.floats(min_value=1e-3, max_value=1e4),
    decode=weights,
    charged=st.floats(min_value=1e-3, max_value=1e5),
    beside=st.dictionaries(st.sampled_from("bcd"), weights, max_size=3),
    remote=weights,
    fraction=st.floats(min_value=0.0, max_value=1.0),
)
def test_the_credit_is_bounded_by_the_cached_share_of_the_prefill_and_moves_no_more_than_it(
    prefill, decode, charged, beside, remote, fraction
):
    call = MeteredCall(charged + decode, charged, prefill, decode, beside, remote)
    credit_ms, moves = prefix_cache_credit(call, 1 - fraction)
    # The uncached share is passed as 1 - fraction, exact to an ulp of 1: hence the absolute term.
    assert 0.0 <= credit_ms <= charged * fraction * (1 + 1e-12) + charged * 1e-15
    assert sum(moves.values()) <= credit_ms * (1 + 1e-9)
    if remote == 0.0 and sum(beside.values()) > 0:
        assert sum(moves.values()) == pytest.approx(credit_ms, rel=1e-9, abs=1e-12)
    more, _ = prefix_cache_credit(call, max(0.0, 1 - fraction - 0.1))
    assert more >= credit_ms * (1 - 1e-9)  # more cached, never less credit


def test_what_would_go_to_its_own_tenants_other_requests_stays_on_it():
    beside = {"a": 30.0, "b": 10.0}  # its tenant's other requests weigh 3x the other tenant's
    call = MeteredCall(500.0, 200.0, 100.0, 11.0, beside, 0.0, tenant="a")
    full, _ = prefix_cache_credit(MeteredCall(500.0, 200.0, 100.0, 11.0, beside, 0.0, tenant="z"), 0.5)
    credit_ms, moves = prefix_cache_credit(call, 0.5)
    assert full > 0 and credit_ms == pytest.approx(full / 4) and moves == {"b": pytest.approx(full / 4)}


@pytest.mark.parametrize(("guessed_uncached", "uncached"), [(100, 500), (500, 100), (1000, 8), (8, 1000)])
def test_a_prefill_sized_too_high_or_too_low_is_settled_to_what_the_engine_prefilled(guessed_uncached, uncached):
    """The meter sized the prefill at ``guessed_uncached`` tokens; the engine prefilled ``uncached``: the
    correction (a credit, or a charge when sized too low) brings the charge to what sizing by ``uncached``
    gives."""
    charged = {tokens: _metered(tokens, uncached) for tokens in (guessed_uncached, uncached)}
    credit_ms, moves = prefix_cache_credit(charged[guessed_uncached], uncached / guessed_uncached)
    assert charged[guessed_uncached].charged_ms - credit_ms == pytest.approx(charged[uncached].charged_ms, rel=1e-9)
    assert (credit_ms > 0) == (uncached < guessed_uncached) and moves == {"b": pytest.approx(credit_ms)}
