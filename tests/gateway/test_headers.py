"""The ``x-ratelimit-*`` values as OpenAI writes them: whole numbers without exponents, durations in Go's
``time.Duration`` form (``20ms``, ``1s``, ``6m0s``) rounded up to the millisecond."""

from __future__ import annotations

import re

import pytest

from fairgate.gateway.headers import quota_headers, rate_limit_headers
from fairgate.ledger.config import Limits, LimitsConfig
from fairgate.ledger.model import QuotaExceeded
from fairgate.ledger.rules import Account
from tests.gateway.conftest import post, serve_stack

GO_DURATION = re.compile(r"0s|[1-9][0-9]{0,2}ms|(?:[1-9][0-9]*h)?(?:[0-9]+m)?[0-9]+(?:\.[0-9]{1,3})?s")


def seconds_of(text: str) -> float:
    """The seconds a reset header says (the form OpenAI's clients parse)."""
    assert GO_DURATION.fullmatch(text), text
    if text.endswith("ms"):
        return int(text[:-2]) / 1000
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?([\d.]+)s", text)
    assert parts is not None
    hours, minutes, seconds = parts.groups()
    return int(hours or 0) * 3600 + int(minutes or 0) * 60 + float(seconds)


@pytest.mark.parametrize(
    "retry_after_s, text",
    [
        (0.0, "0s"),
        (-0.5, "0s"),
        (5.73e-05, "1ms"),  # rounded up: retrying sooner would be refused
        (0.02, "20ms"),
        (0.0201, "21ms"),
        (0.999, "999ms"),
        (0.9991, "1s"),
        (1.0, "1s"),
        (8.64, "8.64s"),
        (59.9999, "1m0s"),
        (360.0, "6m0s"),
        (90.5, "1m30.5s"),
        (3723.004, "1h2m3.004s"),
        (7200.0, "2h0m0s"),
    ],
)
def test_reset_durations_are_go_durations_rounded_up_to_the_millisecond(retry_after_s, text):
    error = QuotaExceeded("acme", "requests_per_minute", retry_after_s, limit=60.0, remaining=0.0)
    assert quota_headers(error)["x-ratelimit-reset-requests"] == text
    assert seconds_of(text) >= retry_after_s


def test_large_and_fractional_limits_are_plain_decimals():
    error = QuotaExceeded("acme", "input_tokens_per_minute", 1.0, limit=4_000_000.0, remaining=12.7)
    headers = quota_headers(error)
    assert headers["x-ratelimit-limit-tokens"] == "4000000"
    assert headers["x-ratelimit-remaining-tokens"] == "12"
    fractional = QuotaExceeded("acme", "requests_per_minute", 1.0, limit=0.0000025, remaining=0.0)
    assert quota_headers(fractional)["x-ratelimit-limit-requests"] == "0.0000025"
    limits = Limits(requests_per_minute=1e20, input_tokens_per_minute=2.5)
    assert rate_limit_headers(limits, None, 0.0) == {
        "x-ratelimit-limit-requests": "100000000000000000000",
        "x-ratelimit-limit-tokens": "2.5",
    }


def test_a_big_bucket_a_few_tokens_short_resets_in_a_millisecond():
    limits = Limits(input_tokens_per_minute=4_000_000.0, requests_per_minute=60.0, requests_burst=5.0)
    account = Account(requests_level=4.0, requests_updated_ms=1000.0, input_level=3_999_996.18, input_updated_ms=1000.0)
    assert rate_limit_headers(limits, account, 1000.0) == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "4",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "4000000",
        "x-ratelimit-remaining-tokens": "3999996",
        "x-ratelimit-reset-tokens": "1ms",  # 3.82 tokens at 4M/min: 57.3 us
    }


def test_headers_of_a_served_request_have_no_exponent(tmp_path):
    defaults = LimitsConfig(input_tokens_per_minute=4_000_000, requests_per_minute=6_000_000)
    with serve_stack(tmp_path, defaults=defaults) as stack:
        reply = post(stack.url, stack.keys["alpha"])
    assert reply.status_code == 200, reply.text
    headers = {name: value for name, value in reply.headers.items() if name.startswith("x-ratelimit-")}
    assert headers["x-ratelimit-limit-tokens"] == "4000000"
    assert headers["x-ratelimit-limit-requests"] == "6000000"
    # One request refills in 10 us at 6M/min: by the time the header is written the buckets are full, or
    # a millisecond (rounded up) short of it.
    assert int(headers["x-ratelimit-remaining-requests"]) in (5_999_999, 6_000_000)
    assert int(headers["x-ratelimit-remaining-tokens"]) in range(3_999_990, 4_000_001)
    assert {headers["x-ratelimit-reset-tokens"], headers["x-ratelimit-reset-requests"]} <= {"0s", "1ms"}
    assert not any("e" in value for value in headers.values()), headers
