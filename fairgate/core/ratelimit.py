"""Token-bucket arithmetic with a capped burst, on a caller-supplied clock (ms): no I/O, no clock of its own.

Source: the classic token bucket (e.g. RFC 2697's committed-burst bucket); seed 003 ("the bucket
capacity must be limited, and an entire month of unused quota cannot be released ... within a
minute"). The bucket may go negative when usage is booked after the fact (output tokens are only
known as they are generated): a debt that refills like any other deficit.

The one implementation in Python: the simulator's quota policies (``TokenBucket``) and the ledger's
per-minute limits (``fairgate.ledger.rules``) both call ``refill`` / ``wait`` / ``credit``. The Redis
ledger runs the same operations in Lua (``fairgate/ledger/redis/scripts/bucket.lua``), in the same order,
so both give the same doubles bit for bit; ``tests/core/test_ratelimit.py`` holds both to one table of cases.
"""

from __future__ import annotations

from dataclasses import dataclass


def refill(
    level: float | None, updated_ms: float, now_ms: float, rate: float, burst: float, per_ms: float = 1.0
) -> tuple[float, float]:
    """The bucket brought up to ``now_ms``: ``(level, updated_ms)``.

    Args:
        level: units held at ``updated_ms`` (negative: a debt); ``None``: a new bucket, full at ``now_ms``.
        rate: units added every ``per_ms`` ms (> 0): ``rate=600, per_ms=60_000`` is 600 a minute.
        burst: the capacity, units; the level never exceeds it (a level above a lowered capacity is cut).

    Elapsed time is never negative: a clock behind ``updated_ms`` reads as no time passed, and the
    bucket's time never moves back.
    """
    if level is None:
        return burst, now_ms
    elapsed = max(0.0, now_ms - updated_ms)
    return min(burst, level + elapsed * rate / per_ms), max(updated_ms, now_ms)


def wait(level: float, need: float, rate: float, per: float = 1.0) -> float:
    """How long until a bucket holding ``level`` holds ``need`` units, refilled at ``rate`` units every
    ``per`` (no other spending meanwhile); in the unit ``per`` is in (``per=60.0`` with a per-minute
    rate: seconds). 0 when it holds them now. ``need`` above the burst is never reached: callers check."""
    return max(0.0, (need - level) / rate * per)


def credit(level: float, units: float, burst: float) -> float:
    """The level after giving back ``units`` (negative: taking them), capped at ``burst``."""
    return min(burst, level + units)


@dataclass(slots=True)
class TokenBucket:
    """A bucket refilled at ``rate_per_ms`` up to ``burst`` units.

    Attributes:
        rate_per_ms: units added per ms (> 0).
        burst: capacity, units (> 0); the bucket starts full.
        level: current units (may be negative after ``spend``).
        updated_ms: the time ``level`` was last brought up to date, ms.
    """

    rate_per_ms: float
    burst: float
    level: float = float("nan")
    updated_ms: float = 0.0

    def __post_init__(self) -> None:
        if not self.rate_per_ms > 0:
            raise ValueError(f"token bucket rate must be > 0, got {self.rate_per_ms}")
        if not self.burst > 0:
            raise ValueError(f"token bucket burst must be > 0, got {self.burst}")
        if self.level != self.level:  # NaN: start full
            self.level = self.burst

    def available(self, now_ms: float) -> float:
        """Units available at ``now_ms``. Reading changes nothing (a clock running backwards reads
        the last level)."""
        return refill(self.level, self.updated_ms, now_ms, self.rate_per_ms, self.burst)[0]

    def spend(self, units: float, now_ms: float) -> None:
        """Refill up to ``now_ms``, then take ``units`` (may leave the bucket negative)."""
        level, self.updated_ms = refill(self.level, self.updated_ms, now_ms, self.rate_per_ms, self.burst)
        self.level = level - units

    def book(self, units: float) -> None:
        """Take ``units`` as of the last ``spend`` (usage booked after the fact, without a clock).

        Booking commutes with other bookings, so usage reported per iteration or summed over many
        iterations leaves the same bucket.
        """
        self.level -= units

    def ready_at(self, units: float, now_ms: float) -> float:
        """Earliest time (ms, >= now) at which ``units`` are available, assuming no other spending.

        ``units`` above ``burst`` are treated as ``burst`` (they could never be available).
        """
        return now_ms + wait(self.available(now_ms), min(units, self.burst), self.rate_per_ms)
