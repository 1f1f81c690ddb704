"""The live meter: GPU time charged to requests in flight on an upstream, from wall-clock intervals.

The gateway cannot see a replica's iterations, only which of its requests are in flight there and when
their tokens arrive (``shared/DESIGN.md``, "Live metering"). The meter integrates the upstream's busy time
(any time with at least one request in flight) and splits every interval among the requests in the
replica's current iteration, in the proportions of the cost model's charge rule (seed 002): each running
sequence weighs ``(iter_base + iter_slope * B) / B``; a request whose first token has not arrived yet is
being prefilled and weighs, in addition, ``prefill_ms_per_token * prompt_tokens`` - the proportions of the
iteration it is prefilled in - until that much prefill time has been attributed to it (or its first token
arrives); any further wait for the first token is charged as decode. The charges of every interval add up
to the interval exactly, so the charges on an upstream add up to its measured busy time.

Iteration boundaries: a replica admits new sequences only between iterations (continuous batching), so a
request sent while an iteration runs is *pending* - it weighs nothing and is not counted in ``B`` - until
the next boundary, which the meter sees as the next token to arrive from any request in flight (every
running sequence emits one per iteration) or a request leaving. A request sent to an idle upstream starts
at once. Without this, a request sent during a long prefill-heavy iteration would be charged for an
iteration it is not in (bench/live_fairness.py's Azure replay measured prompt-heavy tenants over-billed by
10-18 % that way).

Pure: the caller passes ``now_ms`` (any monotonic clock in ms).
"""

from __future__ import annotations

from dataclasses import dataclass

from fairgate.core.cost import CostModel


@dataclass
class _InFlight:
    tenant: str
    prompt_tokens: int
    prefill_left_ms: float  # the cost model's prefill time not yet attributed to it
    prefilling: bool = True
    pending: bool = False  # sent, but the replica has not reached an iteration boundary since
    charged_ms: float = 0.0


@dataclass(frozen=True)
class MeterCharge:
    """GPU ms charged to one request for the interval just metered."""

    request_id: str
    tenant: str
    gpu_ms: float


class LiveMeter:
    """Meters one upstream. Call ``advance(now_ms)`` before every change (the methods below do it)."""

    def __init__(self, cost: CostModel, now_ms: float) -> None:
        self.cost = cost
        self._requests: dict[str, _InFlight] = {}
        self._last_ms = now_ms
        self.busy_ms = 0.0

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    def _weights(self) -> dict[str, float]:
        """Weights of the requests in the current iteration (the pending ones are not in it)."""
        active = {rid: r for rid, r in self._requests.items() if not r.pending}
        batch = len(active)
        if not batch:
            return {}
        decode = self.cost.decode_ms(batch) / batch
        return {rid: decode + (self.cost.prefill_ms(r.prompt_tokens) if r.prefilling else 0.0)
                for rid, r in active.items()}

    def _boundary(self) -> None:
        """An iteration ended: the pending requests join the next one."""
        for request in self._requests.values():
            request.pending = False

    def advance(self, now_ms: float) -> list[MeterCharge]:
        """Charge the interval since the last call to the requests in flight. A clock that went backwards
        charges nothing."""
        interval = now_ms - self._last_ms
        if interval <= 0:
            return []
        self._last_ms = now_ms
        if not self._requests:
            return []
        self.busy_ms += interval
        weights = self._weights()
        if not weights:  # cannot happen (a request is pending only beside an active one); never lose time
            self._boundary()
            weights = self._weights()
        total = sum(weights.values())
        charges = []
        remaining = interval
        items = list(weights.items())
        for index, (rid, weight) in enumerate(items):
            # The last request takes what is left, so the interval is charged exactly, not to rounding.
            share = remaining if index == len(items) - 1 else interval * weight / total
            remaining -= share
            request = self._requests[rid]
            request.charged_ms += share
            if request.prefilling:
                # Its prefill weighs only until the model's prefill time has been attributed to it; time to
                # first token beyond that (HTTP, waiting for an iteration boundary) is charged as decode.
                request.prefill_left_ms -= share * (weight - self.cost.decode_ms(len(items)) / len(items)) / weight
                if request.prefill_left_ms <= 0:
                    request.prefilling = False
            charges.append(MeterCharge(rid, request.tenant, share))
        return charges

    def start(self, request_id: str, tenant: str, prompt_tokens: int, now_ms: float) -> list[MeterCharge]:
        """``request_id`` was sent upstream. Returns the charges of the interval that ended now."""
        charges = self.advance(now_ms)
        assert request_id not in self._requests, f"request {request_id} metered twice"
        prefill_ms = self.cost.prefill_ms(prompt_tokens)
        busy = any(not r.pending for r in self._requests.values())
        self._requests[request_id] = _InFlight(tenant, prompt_tokens, prefill_ms, prefilling=prefill_ms > 0,
                                               pending=busy)
        return charges

    def first_token(self, request_id: str, now_ms: float) -> list[MeterCharge]:
        """Its first token arrived: its prefill is over, and an iteration ended."""
        charges = self.advance(now_ms)
        request = self._requests.get(request_id)
        if request is not None:
            request.prefilling = False
        self._boundary()
        return charges

    def token(self, now_ms: float) -> list[MeterCharge]:
        """A later token of some request arrived: an iteration ended. Returns the interval's charges."""
        charges = self.advance(now_ms)
        self._boundary()
        return charges

    def finish(self, request_id: str, now_ms: float) -> tuple[list[MeterCharge], float]:
        """It left the upstream (done, failed or cancelled). Returns the interval's charges and its total."""
        charges = self.advance(now_ms)
        request = self._requests.pop(request_id)
        self._boundary()
        return charges, request.charged_ms

    def charged_ms(self, request_id: str) -> float:
        """GPU ms charged to ``request_id`` so far."""
        return self._requests[request_id].charged_ms
