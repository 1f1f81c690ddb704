"""OpenAI's rate-limit response headers, from a tenant's limits and ledger balances.

Names and formats follow OpenAI's API (``x-ratelimit-limit-requests``, ``x-ratelimit-remaining-tokens``,
``x-ratelimit-reset-requests`` as a duration such as ``"1.5s"``). "tokens" is the input-token bucket, the
dimension a client controls before sending. Remaining amounts are the bucket levels refilled to ``now_ms``
(``fairgate.ledger.rules.refreshed``); reset is the time until the bucket is full again.
"""

from __future__ import annotations

from fairgate.ledger.config import Limits
from fairgate.ledger.model import QuotaExceeded
from fairgate.ledger.rules import Account, refreshed

_BUCKETS = (("requests", "requests", "requests"), ("tokens", "input_tokens", "input"))


def _duration(seconds: float) -> str:
    return f"{max(0.0, seconds):.3g}s"


def rate_limit_headers(limits: Limits, account: Account | None, now_ms: float) -> dict[str, str]:
    """``x-ratelimit-limit-*`` for each limited bucket and, given the ``account``, ``-remaining-*`` (whole
    units, floored) and ``-reset-*`` (seconds until full). Unlimited buckets get no header."""
    headers: dict[str, str] = {}
    current = refreshed(account, limits, now_ms) if account is not None else None
    for name, dimension, prefix in _BUCKETS:
        rate = getattr(limits, f"{dimension}_per_minute")
        if rate is None:
            continue
        headers[f"x-ratelimit-limit-{name}"] = f"{rate:g}"
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
            headers[f"x-ratelimit-limit-{name}"] = f"{error.limit:g}"
        if error.remaining is not None:
            headers[f"x-ratelimit-remaining-{name}"] = str(max(0, int(error.remaining)))
        if error.retry_after_s is not None:
            headers[f"x-ratelimit-reset-{name}"] = _duration(error.retry_after_s)
    return headers
