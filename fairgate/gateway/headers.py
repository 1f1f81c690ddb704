"""OpenAI's rate-limit response headers, from a tenant's limits and ledger balances.

Names and formats follow OpenAI's API (``x-ratelimit-limit-requests``, ``x-ratelimit-remaining-tokens``,
``x-ratelimit-reset-requests``). "tokens" is the input-token bucket, the dimension a client controls before
sending. Remaining amounts are the bucket levels refilled to ``now_ms`` (``fairgate.ledger.rules.refreshed``);
reset is the time until the bucket is full again.

Formats, never in exponent notation: limits are plain decimals (``4000000``; a fractional rate as
``2.5``), remaining amounts whole units, floored. Reset times are written as OpenAI writes them, in the
form of Go's ``time.Duration`` (``0s``, ``20ms``, ``1s``, ``8.64s``, ``6m0s``, ``1h2m3.004s``): below a
second whole milliseconds, from a second on hours and minutes when non-zero, then seconds with up to three
decimals; always rounded *up* to the millisecond, so a client that waits that long is not refused for
being early.
"""

from __future__ import annotations

import math
from decimal import Decimal

from fairgate.ledger.config import Limits
from fairgate.ledger.model import QuotaExceeded
from fairgate.ledger.rules import Account, refreshed

_BUCKETS = (("requests", "requests", "requests"), ("tokens", "input_tokens", "input"))


def _number(value: float) -> str:
    """``value`` as a plain decimal: an integer without a fraction, else its shortest exact digits."""
    if value == int(value):
        return str(int(value))
    return format(Decimal(repr(value)), "f")


def _duration(seconds: float) -> str:
    """``seconds`` (finite) as a Go duration, rounded up to the millisecond (see the module docstring)."""
    # round() first: 0.3 s arrives as 300.00000000000006 ms, which must not round up to 301 ms.
    ms = max(0, math.ceil(round(seconds * 1000.0, 6)))
    if ms < 1000:
        return f"{ms}ms" if ms else "0s"
    hours, rest_ms = divmod(ms, 3_600_000)
    minutes, rest_ms = divmod(rest_ms, 60_000)
    whole, fraction = divmod(rest_ms, 1000)
    text = f"{whole}.{fraction:03d}".rstrip("0").rstrip(".") + "s"
    if hours or minutes:
        text = f"{minutes}m{text}"
    return f"{hours}h{text}" if hours else text


def rate_limit_headers(limits: Limits, account: Account | None, now_ms: float) -> dict[str, str]:
    """``x-ratelimit-limit-*`` for each limited bucket and, given the ``account``, ``-remaining-*`` (whole
    units, floored) and ``-reset-*`` (seconds until full). Unlimited buckets get no header."""
    headers: dict[str, str] = {}
    current = refreshed(account, limits, now_ms) if account is not None else None
    for name, dimension, prefix in _BUCKETS:
        rate = getattr(limits, f"{dimension}_per_minute")
        if rate is None:
            continue
        headers[f"x-ratelimit-limit-{name}"] = _number(rate)
        if current is None:
            continue
        level = getattr(current, f"{prefix}_level")
        burst = limits.burst(dimension) or 0.0
        level = burst if level is None else level
        headers[f"x-ratelimit-remaining-{name}"] = str(max(0, int(level)))
        headers[f"x-ratelimit-reset-{name}"] = _duration((burst - level) / rate * 60.0)
    return headers


def quota_headers(error: QuotaExceeded) -> dict[str, str]:
    """Headers for a 429 from the ledger: the limit and what remains of the dimension at fault."""
    headers = {"x-fairgate-quota-dimension": error.dimension}
    name = {"requests_per_minute": "requests", "input_tokens_per_minute": "tokens"}.get(error.dimension)
    if name is not None:
        if error.limit is not None:
            headers[f"x-ratelimit-limit-{name}"] = _number(error.limit)
        if error.remaining is not None:
            headers[f"x-ratelimit-remaining-{name}"] = str(max(0, int(error.remaining)))
        if error.retry_after_s is not None:
            headers[f"x-ratelimit-reset-{name}"] = _duration(error.retry_after_s)
    return headers
