"""The live meter: GPU time charged to requests in flight on an upstream, from wall-clock intervals.

The gateway cannot see a replica's iterations, only which of its requests are in flight there and when
their tokens arrive (``shared/DESIGN.md``, "Live metering"). The meter integrates the upstream's busy time
(any time with at least one request in flight) and splits every interval among the requests in the
replica's current iteration, in the proportions of the cost model's charge rule (seed 002): each running
sequence weighs ``(iter_base + iter_slope * B) / B``; a request whose first token has not arrived yet is
being prefilled and weighs, in addition, ``prefill_ms_per_token * prompt_tokens`` - the proportions of the
iteration it is prefilled in - until that much prefill time has been attributed to it (or its first token
arrives); any further wait for the first token is charged as decode. A request of ``n`` sequences
(OpenAI's ``n``) counts ``n`` in ``B`` and weighs ``n`` decode shares, plus its prompt's prefill once (the
replica prefills a shared prompt once). The charges of every interval add up
to the interval exactly, so the charges on an upstream add up to its measured busy time.

Iteration boundaries: a replica admits new sequences only between iterations (continuous batching), so a
request sent while an iteration runs is *pending* - it weighs nothing and is not counted in ``B`` - until
the next boundary, which the meter sees as the next token to arrive from any request in flight (every
running sequence emits one per iteration) or a request leaving - but not a token that arrives less than
``boundary_lag_ms`` after the request was sent: the tokens of one iteration arrive as a burst, spread over
the time the gateway takes to read them, and a request sent amid the burst (its slot freed by a request
that ended in it) was not in the iteration the rest of the burst ends. The default lag is half the cost
model's shortest iteration (``iter_base_ms / 2``): closer than that, two tokens cannot end two different
iterations. A request sent to an idle upstream starts at once. Without this, a request sent during a long
prefill-heavy iteration would be charged for an iteration it is not in (bench/live_fairness.py's Azure
replay measured prompt-heavy tenants over-billed by 10-18 % that way).

Several gateway processes on one replica (scale-out): each process sees only its own requests, yet
the replica's iterations hold everyone's. Metering its own requests alone, every process would bill the
replica's whole busy time (x N with N processes). So each process publishes its meter's *occupancy* over
the last round (``take_occupancy``): the time-averaged number of its requests in the iteration, and the
share of the replica's time spent prefilling them (prefill ms attributed per ms); every process tells its
meter the sum of the others' (``set_remote``). A meter then takes the remote prefill share off every
interval, and splits the rest among its own requests' weights and the remote sequences (which count in
``B`` and weigh as decoding sequences); it charges only its own requests' part. The remote prefill is a
share of time, not a weight: prefill comes in spikes (one iteration per request), and an averaged spike
used as a weight under-bills the process that does not prefill, while a share of time taken off every
interval is right on average (tests/core/test_meter.py, the two-process simulation). Over the processes the
charges add up to the replica's busy time as far as last round's averages describe this one. With no
remote occupancy (one process) the split is the exact one above.

Pure: the caller passes ``now_ms`` (any monotonic clock in ms).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fairgate.core.cost import CostModel

# The most of an interval the other processes' prefill can take off it: a guard against a share summed
# from stale or overlapping rounds leaving this process's requests nothing (their prefill and decode run).
MAX_REMOTE_PREFILL_SHARE = 0.9


@dataclass
class _InFlight:
    tenant: str
    prompt_tokens: int
    prefill_left_ms: float  # the cost model's prefill time not yet attributed to it
    prefilling: bool = True
    pending: bool = False  # sent, but the replica has not reached an iteration boundary since
    sent_ms: float = 0.0
    charged_ms: float = 0.0
    sequences: int = 1  # OpenAI's ``n``: it holds that many places in the batch, its prompt prefilled once


@dataclass(frozen=True)
class Occupancy:
    """What a meter's requests held of its upstream's iterations over a window, time-averaged.

    ``sequences``: requests in the iteration (pending ones excluded); ``prefill_share``: prefill ms attributed
    to them per ms of the window (the share of the upstream's time spent prefilling them, 0-1)."""

    sequences: float = 0.0
    prefill_share: float = 0.0


@dataclass(frozen=True)
class MeterCharge:
    """GPU ms charged to one request for the interval just metered."""

    request_id: str
    tenant: str
    gpu_ms: float


class LiveMeter:
    """Meters one upstream. Call ``advance(now_ms)`` before every change (the methods below do it)."""

    def __init__(self, cost: CostModel, now_ms: float, boundary_lag_ms: float | None = None) -> None:
        self.cost = cost
        self.boundary_lag_ms = cost.iter_base_ms / 2 if boundary_lag_ms is None else boundary_lag_ms
        self._requests: dict[str, _InFlight] = {}
        self._last_ms = now_ms
        self.busy_ms = 0.0  # time with at least one of its requests in flight
        self.charged_total_ms = 0.0  # charged to its requests: busy_ms when no other process shares it
        self.remote = Occupancy()  # the other gateway processes' requests on the same replica
        self._window_start_ms = now_ms
        self._sequence_ms = 0.0  # its own requests' occupancy since the window started: sequences x ms
        self._prefill_attributed_ms = 0.0  # and prefill ms attributed

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    @property
    def prefilling(self) -> bool:
        """Whether a request in flight is pending or being prefilled (the iteration is no plain decode step)."""
        return any(r.prefilling or r.pending for r in self._requests.values())

    @property
    def sequences(self) -> int:
        """Sequences of its requests in flight (a request of ``n`` counts ``n``)."""
        return sum(r.sequences for r in self._requests.values())

    def _weights(self) -> tuple[dict[str, float], float]:
        """Weights of this process's requests in the current iteration (the pending ones are not in it), and
        the weight of the other processes' (``remote``) in it."""
        active = {rid: r for rid, r in self._requests.items() if not r.pending}
        if not active:
            return {}, 0.0
        batch = sum(r.sequences for r in active.values()) + self.remote.sequences
        decode = (self.cost.iter_base_ms + self.cost.iter_slope_ms * batch) / batch
        # Each sequence weighs dt / B; a request of n sequences shares one prompt, prefilled once.
        weights = {
            rid: decode * r.sequences + (self.cost.prefill_ms(r.prompt_tokens) if r.prefilling else 0.0)
            for rid, r in active.items()
        }
        return weights, decode * self.remote.sequences

    def _boundary(self, now_ms: float | None = None) -> None:
        """An iteration ended at ``now_ms``: the pending requests sent at least ``boundary_lag_ms`` before
        join the next one (all of them when ``now_ms`` is None)."""
        for request in self._requests.values():
            if now_ms is None or now_ms - request.sent_ms >= self.boundary_lag_ms:
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
        weights, remote_weight = self._weights()
        if not weights:  # cannot happen (a request is pending only beside an active one); never lose time
            self._boundary()
            weights, remote_weight = self._weights()
        own_weight = sum(weights.values())
        self._sequence_ms += sum(self._requests[rid].sequences for rid in weights) * interval
        # The others' prefill takes its share of the interval; the rest is split by weight, and the remote
        # sequences' part is theirs to charge.
        shared_ms = interval * (1.0 - min(self.remote.prefill_share, MAX_REMOTE_PREFILL_SHARE))
        own_ms = shared_ms * own_weight / (own_weight + remote_weight)
        self.charged_total_ms += own_ms
        charges = []
        remaining = own_ms
        items = list(weights.items())
        for index, (rid, weight) in enumerate(items):
            # The last request takes what is left, so the interval is charged exactly, not to rounding.
            share = remaining if index == len(items) - 1 else own_ms * weight / own_weight
            remaining -= share
            request = self._requests[rid]
            request.charged_ms += share
            if request.prefilling:
                # Its prefill weighs only until the model's prefill time has been attributed to it; time to
                # first token beyond that (HTTP, waiting for an iteration boundary) is charged as decode.
                prefill_part = share * self.cost.prefill_ms(request.prompt_tokens) / weight
                self._prefill_attributed_ms += min(prefill_part, request.prefill_left_ms)
                request.prefill_left_ms -= prefill_part
                if request.prefill_left_ms <= 0:
                    request.prefilling = False
            charges.append(MeterCharge(rid, request.tenant, share))
        return charges

    def take_occupancy(self) -> Occupancy:
        """This meter's requests' occupancy, averaged from the last call (or the start) to the last
        ``advance``; starts a new window. Call ``advance`` first to include the time up to now. A window of
        no time gives the requests in the iteration now, and no prefill."""
        span = self._last_ms - self._window_start_ms
        if span > 0:
            taken = Occupancy(self._sequence_ms / span, min(1.0, self._prefill_attributed_ms / span))
        else:
            taken = Occupancy(float(sum(r.sequences for r in self._requests.values() if not r.pending)))
        self._window_start_ms = self._last_ms
        self._sequence_ms = self._prefill_attributed_ms = 0.0
        return taken

    def set_remote(self, remote: Occupancy, now_ms: float) -> list[MeterCharge]:
        """From ``now_ms`` the other processes hold ``remote`` of the upstream (see module docstring).
        Returns the charges of the interval that ended now (split with the previous remote occupancy).

        Raises:
            ValueError: a negative or non-finite count, or a prefill share outside 0-1.
        """
        if not (0 <= remote.sequences < math.inf and 0 <= remote.prefill_share <= 1):
            raise ValueError(f"remote occupancy must be finite and >= 0, got {remote}")
        charges = self.advance(now_ms)
        self.remote = remote
        return charges

    def start(
        self, request_id: str, tenant: str, prompt_tokens: int, now_ms: float, sequences: int = 1
    ) -> list[MeterCharge]:
        """``request_id`` was sent upstream, running ``sequences`` (OpenAI's ``n``). Returns the charges of
        the interval that ended now."""
        charges = self.advance(now_ms)
        assert request_id not in self._requests, f"request {request_id} metered twice"
        prefill_ms = self.cost.prefill_ms(prompt_tokens)
        busy = any(not r.pending for r in self._requests.values())
        self._requests[request_id] = _InFlight(
            tenant,
            prompt_tokens,
            prefill_ms,
            prefilling=prefill_ms > 0,
            pending=busy,
            sent_ms=now_ms,
            sequences=sequences,
        )
        return charges

    def first_token(self, request_id: str, now_ms: float) -> list[MeterCharge]:
        """Its first token arrived: its prefill is over, and an iteration ended."""
        charges = self.advance(now_ms)
        request = self._requests.get(request_id)
        if request is not None:
            request.prefilling = request.pending = False  # it was in the iteration that ended
        self._boundary(now_ms)
        return charges

    def token(self, now_ms: float) -> list[MeterCharge]:
        """A later token of some request arrived: an iteration ended. Returns the interval's charges."""
        charges = self.advance(now_ms)
        self._boundary(now_ms)
        return charges

    def finish(self, request_id: str, now_ms: float) -> tuple[list[MeterCharge], float]:
        """It left the upstream (done, failed or cancelled). Returns the interval's charges and its total."""
        charges = self.advance(now_ms)
        request = self._requests.pop(request_id)
        self._boundary(now_ms)
        return charges, request.charged_ms

    def charged_ms(self, request_id: str) -> float:
        """GPU ms charged to ``request_id`` so far."""
        return self._requests[request_id].charged_ms
