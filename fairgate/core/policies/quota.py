"""Policies that hold requests back: per-tenant request and token quotas, and a per-tenant slot cap.

All three choose first-come-first-served among the tenants they let through, so the only thing they
change relative to FCFS is the limit (seed 002's "equal requests/min quota" and "slot cap" rows).
"""

from __future__ import annotations

import math

from fairgate.core.policy import QueuedPolicy
from fairgate.core.ratelimit import TokenBucket
from fairgate.core.request import RunningView

_MS_PER_MINUTE = 60_000.0
_EPSILON = 1e-9  # tolerance on bucket levels, so a wake-up computed in float is never a near miss
_ONE_REQUEST = 1.0 - _EPSILON


def _level(b: TokenBucket, now_ms: float) -> float:
    """``refill(b.level, b.updated_ms, now_ms, b.rate_per_ms, b.burst)[0]``: the same float operations in the same
    order (``max(0.0, x)`` is ``x if x > 0.0 else 0.0``, ``min(burst, x)`` is ``x if x < burst else burst``, and a
    division by ``per_ms = 1.0`` is exact), without building the pair; ``_eligible`` and ``_ready_at`` write it out
    in their loops. The bucket's level is never ``None`` (a ``TokenBucket`` starts full)."""
    elapsed = now_ms - b.updated_ms
    level = b.level + (elapsed if elapsed > 0.0 else 0.0) * b.rate_per_ms
    return level if level < b.burst else b.burst


class _BucketPolicy(QueuedPolicy):
    """A token bucket per tenant, made on first use.

    A held tenant's bucket is read at every scheduling point of a run (whether it is eligible, and when it
    will be): those reads do the arithmetic of ``TokenBucket.available`` and ``ready_at`` (``ratelimit.refill``
    and ``ratelimit.wait``) on the bucket's fields, written out float operation for float operation (``_level``),
    without a call per read (a third of a quota policy's time in the simulator).
    """

    _by_prompt = False  # a head request needs its prompt tokens (capped at the burst), else one unit

    def __init__(self, rate_per_ms: float, burst: float) -> None:
        super().__init__()
        self._rate_per_ms = rate_per_ms
        self._burst = burst
        self._buckets: dict[str, TokenBucket] = {}

    def _bucket(self, tenant: str) -> TokenBucket:
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = TokenBucket(self._rate_per_ms, self._burst)
        return bucket

    def _on_backlogged(self, tenant: str, now_ms: float) -> None:
        self._bucket(tenant)  # a bucket starts full whenever it is made: every queued tenant has one

    def _eligible(self, now_ms: float) -> list[str]:
        """The queued tenants whose bucket holds their head request's need at ``now_ms``."""
        buckets, burst, by_prompt = self._buckets, self._burst, self._by_prompt
        eligible = []
        for tenant, queue in self._queues.items():
            need = min(float(queue[0].prompt_tokens), burst) - _EPSILON if by_prompt else _ONE_REQUEST
            b = buckets[tenant]
            # ``refill(...)[0]`` written out (see ``_level``): this runs for every queued tenant at every pick
            elapsed = now_ms - b.updated_ms
            level = b.level + (elapsed if elapsed > 0.0 else 0.0) * b.rate_per_ms
            if (level if level < b.burst else b.burst) >= need:
                eligible.append(tenant)
        return eligible

    def _ready_at(self, now_ms: float) -> float:
        """The earliest instant a queued tenant's bucket holds its head request's need (``TokenBucket.ready_at``)."""
        buckets, burst, by_prompt, best = self._buckets, self._burst, self._by_prompt, float("inf")
        for tenant, queue in self._queues.items():
            need = min(float(queue[0].prompt_tokens), burst) - _EPSILON if by_prompt else _ONE_REQUEST
            b = buckets[tenant]
            # ``wait(refill(...)[0], min(need, burst), rate)`` written out (see ``_level``)
            elapsed = now_ms - b.updated_ms
            level = b.level + (elapsed if elapsed > 0.0 else 0.0) * b.rate_per_ms
            wanted = (b.burst if b.burst < need else need) - (level if level < b.burst else b.burst)
            waited = wanted / b.rate_per_ms
            ready = now_ms + (waited if waited > 0.0 else 0.0)
            if ready < best:
                best = ready
        return best


class RequestQuota(_BucketPolicy):
    """Each tenant may start ``requests_per_minute`` requests per minute (token bucket, capped burst).

    Source: seed 002, "equal requests/min quota" (100 requests/min per tenant: max/min 6.87).

    Args:
        requests_per_minute: sustained admission rate per tenant (> 0).
        burst_requests: bucket capacity per tenant (>= 1).
    """

    name = "request_quota"

    def __init__(self, requests_per_minute: float, burst_requests: float = 1.0) -> None:
        if not requests_per_minute > 0:
            raise ValueError(f"requests_per_minute must be > 0, got {requests_per_minute}")
        if not burst_requests >= 1:
            raise ValueError(f"burst_requests must be >= 1, got {burst_requests}")
        super().__init__(requests_per_minute / _MS_PER_MINUTE, float(burst_requests))
        # tenant -> (lo, hi): its bucket, as it is since its last pick, holds no request at or before lo and holds
        # one from hi on (see _bracket)
        self._brackets: dict[str, tuple[float, float]] = {}

    def _select(self, now_ms: float, running: RunningView) -> str | None:
        # A held tenant's bucket is asked at every scheduling point (a third of this policy's time in a
        # simulation) but changes only when the tenant is picked: where it starts to hold a request is
        # bracketed once, and the bucket asked only between the bracket's ends.
        brackets, buckets, eligible = self._brackets, self._buckets, []
        for tenant in self._queues:
            bracket = brackets.get(tenant)
            if bracket is None:
                bracket = brackets[tenant] = self._bracket(tenant)
            if now_ms >= bracket[1] or (now_ms > bracket[0] and _level(buckets[tenant], now_ms) >= _ONE_REQUEST):
                eligible.append(tenant)
        return self._earliest(eligible) if eligible else None

    def _bracket(self, tenant: str) -> tuple[float, float]:
        """``(lo, hi)``: ``tenant``'s bucket, left as it is, holds a request (``available(now) >= 1 - epsilon``) at
        no ``now <= lo`` and at every ``now >= hi``. ``refill`` never falls as ``now`` grows (each of its float
        operations keeps order), so both ends, checked with ``refill`` itself, bound every instant: around the
        closed-form instant, a margin apart. ``(-inf, inf)`` (ask the bucket every time) if that fails."""
        b = self._buckets[tenant]

        def holds(t: float) -> bool:
            return _level(b, t) >= _ONE_REQUEST

        if holds(-math.inf):
            return -math.inf, -math.inf
        if b.burst < _ONE_REQUEST:
            return math.inf, math.inf
        t = b.updated_ms + (_ONE_REQUEST - b.level) / b.rate_per_ms
        if not math.isfinite(t):
            return -math.inf, math.inf
        margin = 1e-9 * (1.0 + abs(t))
        if holds(t):
            lo, hi, found = t - margin, t, not holds(t - margin)
        else:
            lo, hi, found = t, t + margin, holds(t + margin)
        return (lo, hi) if found else (-math.inf, math.inf)

    def _on_pick(self, request, now_ms: float) -> None:  # type: ignore[no-untyped-def]
        self._bucket(request.tenant).spend(1.0, now_ms)
        self._brackets.pop(request.tenant, None)

    def wake_at(self, now_ms: float) -> float | None:
        if not self._queues:
            return None
        return self._ready_at(now_ms)


class TokenQuota(_BucketPolicy):
    """Each tenant may spend ``tokens_per_minute`` tokens (prompt + generated) per minute.

    Prompt tokens are booked at admission, output tokens as they are generated (the bucket may go
    into debt, since output length is unknown at admission). A tenant's head request is admitted once
    its bucket holds the request's prompt tokens (capped at the burst).

    Source: token-per-minute limits of hosted LLM APIs; the token bucket of ``core.ratelimit``.

    Args:
        tokens_per_minute: sustained rate per tenant (> 0).
        burst_tokens: bucket capacity per tenant (> 0); default ten seconds' worth
            (``tokens_per_minute / 6``), so unused quota never piles up.
    """

    name = "token_quota"
    _by_prompt = True

    def __init__(self, tokens_per_minute: float, burst_tokens: float | None = None) -> None:
        if not tokens_per_minute > 0:
            raise ValueError(f"tokens_per_minute must be > 0, got {tokens_per_minute}")
        burst = tokens_per_minute / 6.0 if burst_tokens is None else float(burst_tokens)
        if not burst > 0:
            raise ValueError(f"burst_tokens must be > 0, got {burst_tokens}")
        super().__init__(tokens_per_minute / _MS_PER_MINUTE, burst)

    def _select(self, now_ms: float, running: RunningView) -> str | None:
        eligible = self._eligible(now_ms)
        return self._earliest(eligible) if eligible else None

    def _on_pick(self, request, now_ms: float) -> None:  # type: ignore[no-untyped-def]
        self._bucket(request.tenant).spend(request.prompt_tokens, now_ms)

    def charge(
        self, tenant: str, gpu_ms: float, input_tokens: int, output_tokens: int, batch_size: int, remote: bool = False
    ) -> None:
        # Prompt tokens were taken at pick time; generated tokens are booked as they come.
        self._bucket(tenant).book(output_tokens)

    def wake_at(self, now_ms: float) -> float | None:
        if not self._queues:
            return None
        return self._ready_at(now_ms)


class SlotCap(QueuedPolicy):
    """No tenant may hold more than ``max_running`` running sequences; FCFS among the rest.

    Source: seed 002, "slot cap" (``max_batch / n`` = 6 per tenant: decode splits evenly, but prefill,
    31.3 % of the machine, is uncapped, and the split scores 1.92).

    Args:
        max_running: running sequences allowed per tenant, across all replicas (>= 1).
    """

    name = "slot_cap"

    def __init__(self, max_running: int) -> None:
        super().__init__()
        if isinstance(max_running, bool) or not isinstance(max_running, int) or max_running < 1:
            raise ValueError(f"max_running must be an integer >= 1, got {max_running!r}")
        self._max_running = max_running

    def _select(self, now_ms: float, running: RunningView) -> str | None:
        eligible = [t for t in self._queues if running.running(t) < self._max_running]
        return self._earliest(eligible) if eligible else None
