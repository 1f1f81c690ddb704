"""The cost model of a continuous-batching replica and the GPU-time charge rule.

Source: the seed document ``shared/seeds/002_26e0ae7acb221c9a.txt`` and ``shared/DESIGN.md``:

    an iteration with B running sequences, of which some were admitted (prefilled) in it:
      dt      = iter_base_ms + iter_slope_ms * B + prefill_ms_per_token * (prompt tokens prefilled now)
      each running sequence is charged (iter_base_ms + iter_slope_ms * B) / B
      each newly admitted one is charged, in addition, prefill_ms_per_token * its prompt tokens

so the charges of an iteration add up to its ``dt`` exactly.

Engines keep time in integer nanoseconds so that two engines computing the same boundary by
different routes (``t + dt + dt`` or ``t + 2 * dt``) agree exactly. The cost model therefore
rounds each parameter to whole nanoseconds once, at construction; every duration it returns is
an exact sum of those integers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NS_PER_MS = 1_000_000


@dataclass(frozen=True, slots=True)
class CostModel:
    """Iteration time of one replica as a function of batch size and prefilled tokens.

    Attributes:
        iter_base_ms: fixed time of one iteration, ms (> 0).
        iter_slope_ms: added time per running sequence, ms (>= 0).
        prefill_ms_per_token: prefill time per prompt token admitted in the iteration, ms (>= 0).
        max_batch: maximum running sequences (slots) per replica (>= 1).

    Raises:
        ValueError: a parameter is out of range (the message names it).
    """

    iter_base_ms: float
    iter_slope_ms: float
    prefill_ms_per_token: float
    max_batch: int
    _base_ns: int = field(init=False, repr=False, compare=False)
    _slope_ns: int = field(init=False, repr=False, compare=False)
    _prefill_ns_per_token: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.iter_base_ms > 0:
            raise ValueError(f"iter_base_ms must be > 0, got {self.iter_base_ms}")
        if not self.iter_slope_ms >= 0:
            raise ValueError(f"iter_slope_ms must be >= 0, got {self.iter_slope_ms}")
        if not self.prefill_ms_per_token >= 0:
            raise ValueError(f"prefill_ms_per_token must be >= 0, got {self.prefill_ms_per_token}")
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {self.max_batch!r}")
        object.__setattr__(self, "_base_ns", round(self.iter_base_ms * NS_PER_MS))
        object.__setattr__(self, "_slope_ns", round(self.iter_slope_ms * NS_PER_MS))
        object.__setattr__(self, "_prefill_ns_per_token", round(self.prefill_ms_per_token * NS_PER_MS))

    # --- milliseconds (for people, policies and the gateway) ---------------------------------
    def decode_ms(self, batch: int) -> float:
        """Decode part of an iteration with ``batch`` running sequences, ms."""
        return self.decode_ns(batch) / NS_PER_MS

    def prefill_ms(self, prompt_tokens: int) -> float:
        """Prefill time of ``prompt_tokens`` admitted in one iteration, ms."""
        return self.prefill_ns(prompt_tokens) / NS_PER_MS

    def iteration_ms(self, batch: int, prefill_tokens: int = 0) -> float:
        """``dt`` of an iteration with ``batch`` running sequences and ``prefill_tokens`` prefilled, ms."""
        return (self.decode_ns(batch) + self.prefill_ns(prefill_tokens)) / NS_PER_MS

    def decode_charge_ms(self, batch: int) -> float:
        """What one running sequence is charged for one iteration: ``dt_decode / B``, ms."""
        return self.decode_ns(batch) / batch / NS_PER_MS

    def worst_case_ms(self, prompt_tokens: int, output_tokens: int) -> float:
        """The most the charge rule (seed 002: each running sequence pays ``dt / B`` of every iteration) can
        charge one request of ``prompt_tokens`` and ``output_tokens``, ms: its prefill, plus every token
        decoded alone. ``decode_charge_ms(B) = iter_base / B + iter_slope`` falls with ``B``, so a batch of
        one is the dearest; a reservation of this much is never outspent by a replica the model describes."""
        return self.prefill_ms(prompt_tokens) + output_tokens * self.decode_charge_ms(1)

    def vtc_exchange_rate(self, batch: int) -> float:
        """Output-token weight that makes VTC's counter equal GPU time at batch size ``batch``.

        ``(iter_base + iter_slope * B) / (B * prefill_ms_per_token)``: one decode token's cost in
        units of one prompt token's prefill cost (seed 002: 15.42 at B=24 for (9, 0.55, 0.06)).

        Raises:
            ValueError: ``prefill_ms_per_token`` is 0 (the rate is infinite).
        """
        if self.prefill_ms_per_token == 0:
            raise ValueError("vtc_exchange_rate needs prefill_ms_per_token > 0")
        return (self.iter_base_ms + self.iter_slope_ms * batch) / (batch * self.prefill_ms_per_token)

    # --- integer nanoseconds (for the engines) ----------------------------------------------
    def decode_ns(self, batch: int) -> int:
        """Decode part of an iteration with ``batch`` running sequences, integer ns."""
        return self._base_ns + self._slope_ns * batch

    def prefill_ns(self, prompt_tokens: int) -> int:
        """Prefill time of ``prompt_tokens``, integer ns."""
        return self._prefill_ns_per_token * prompt_tokens
