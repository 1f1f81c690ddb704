"""Token bucket with a capped burst, on a caller-supplied clock (ms).

Source: the classic token bucket (e.g. RFC 2697's committed-burst bucket); seed 003 ("the bucket
capacity must be limited, and an entire month of unused quota cannot be released ... within a
minute"). The bucket may go negative when usage is booked after the fact (output tokens are only
known as they are generated): a debt that refills like any other deficit.
"""

from __future__ import annotations

from dataclasses import dataclass


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
        if now_ms <= self.updated_ms:
            return self.level
        return min(self.burst, self.level + (now_ms - self.updated_ms) * self.rate_per_ms)

    def spend(self, units: float, now_ms: float) -> None:
        """Refill up to ``now_ms``, then take ``units`` (may leave the bucket negative)."""
        self.level = self.available(now_ms) - units
        self.updated_ms = max(self.updated_ms, now_ms)

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
        need = min(units, self.burst)
        level = self.available(now_ms)
        if level >= need:
            return now_ms
        return now_ms + (need - level) / self.rate_per_ms
