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
running sequence emits one per iteration) - but not a token that arrives less than
``boundary_lag_ms`` after the request was sent: the tokens of one iteration arrive as a burst, spread over
the time the gateway takes to read them, and a request sent amid the burst (its slot freed by a request
that ended in it) was not in the iteration the rest of the burst ends. The default lag is half the cost
model's shortest iteration (``iter_base_ms / 2``): closer than that, two tokens cannot end two different
iterations. Without this, a request sent during a long prefill-heavy iteration would be charged for an
iteration it is not in (bench/live_fairness.py's Azure replay measured prompt-heavy tenants over-billed by
10-18 % that way). Two exceptions, both measured on llama-server:

- A request sent to an idle upstream starts at once, and so does every request sent less than
  ``boundary_lag_ms`` after it (this process alone on it): an idle engine takes in whatever reaches it before
  its first step starts (one request and seven sent 2 ms later were prefilled in one 1,345-ms step; the
  first was billed all of it), and nothing later (``joins_first_iteration``).
- A request's own first token is evidence of the iteration it was prefilled in. Arriving while the meter
  still has it pending, or within ``boundary_lag_ms`` of the burst it joined at, it ends the iteration
  *before* the one the meter put it in: it made the very next step after all (llama-server took requests
  sent up to 15 ms after a step's tokens), and that step was charged to the others.

  Its first token then settles its prefill: the requests charged for that step give back its part of it
  (``repaid_prefill``). The step is the window from the first token of the burst that began it (each burst's
  first token marks every charge: O(in flight) once an iteration); its part is what it would have been charged
  there at its weight, at most the model's prefill and its decode share, and no more than the others were
  charged in the window at their decode weight, which each gives back in proportion: a prefill, its own or
  another's, is charged the model's time either way. Charged back over the iterations after instead, the
  prefill of a request whose first token is its last (max_tokens = 1) was never charged (through an emulated
  replica, such requests were billed 7 % under the replica's own charge rule); given back by the others'
  weights at the first token, a request prefilled beside it kept the part of the step the meter gave it and
  the decoders paid for it (an outside tester: decoders billed 0.07 ms of a truth of 18).

  Otherwise a first token ends the prefill weight with what has been attributed: an early one is the engine's
  word that the prefill took less than the model says (its prefix cache held part of the prompt). The cost of
  believing it: when the gateway reads the burst a request joined at late, the interval it is weighed in is
  shorter than the step, and what it misses is not made up (a long interval is capped at the model's prefill),
  so jitter in reading bursts bills prefill-heavy requests a little under (through the emulated replica,
  about 2 % of a tenant of 1-3-token replies).

A request cut by its caller (the client left, a deadline) leaves as an engine lets it go: between steps (vLLM
and llama.cpp take aborts then; the emulated replica charges such a sequence its whole step), and only once the
abort has reached it: a step that begins less than ``boundary_lag_ms`` after the cut may have taken the request
in all the same. So one in the running step stays in it, weighed as before, until the first step's end that
late after the cut - a burst's first token, or the cost model's end of the whole step (every prefill in it)
when no token of this process's can end it (``cut``, ``depart``, ``step_left_ms``); it then weighs nothing and
leaves when that burst is over, lending to a late request's prefill meanwhile. One pending that may be in the
running step (sent within ``boundary_lag_ms`` of that step's first token: before it, or after it where the
engine takes such requests, ``admits_after_burst``) joins it as at its first token; one pending for a later step
leaves when that step starts, or joins it when the step starts within the lag of the cut. One alone in its
process beside other processes' requests, whose step's end no token of its own can tell, stays for the model's
step times the chance the replica took it in (``leave_after_ms``). Through
the emulated replica (tests/gateway/test_meter_truth.py), long prompts cut 5-250 ms after their send beside a
decoding tenant were billed 1.004-1.008 of the replica's charge rule, the decoders 0.990-0.996 (three seeds);
let go at the cut (billed the part of the prefill step gone by, nothing when pending), 0.56-0.59 and 1.56-1.66.
Outside testers' timed cuts (several prompts cut together in one step; a prompt cut 1 ms before the step that
took it in) are each a test in tests/core/test_meter.py: a rule that stopped a request at the first burst after
its cut, or gave a step one prefill's time, billed the attacker 0.24-0.55 of the charge rule and its victims
1.30-1.63; this one, 1.00-1.06 and 0.98-1.00.

The decode step the weights use is the cost model's times ``decode_scale`` (``set_decode_scale``; 1 by
default): the gateway sets it to the drift check's observed / predicted decode step (``fairgate.core.drift``).
In a plain decode step it changes nothing (every sequence weighs alike); in an iteration that also prefills,
it is what the decoding sequences' part is measured by. On llama-server on a loaded 2-core machine the decode
steps ran 25-32 % above the calibrated model while the prompts' prefill kept to it, and the unscaled weights
gave the prompts of every such iteration the decode steps' excess: the short-output tenants, whose requests
are most of the prefills, were billed more than the engine's own log says they used.

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

Cost per event: a token that changes nothing but the time (no request pending, no prefill ending, not the first
of a burst) is O(1).
Between changes of the batch every request's weight is fixed, so the meter keeps one running integral, the
``price`` (ms charged per unit of weight so far), and each request its weight and the price when its charge
was last brought up to date: its charge is ``charged + weight * (price - mark)``, read when asked
(``charged_ms``). A change of ``B`` (a request joining the iteration or leaving it, the remote occupancy)
changes every weight and brings every charge up to date: O(in flight) per request, not per token. A
request's prefill is attributed at ``prefill_ms`` per unit of price from when it joins the iteration, so it
is all attributed once the price has risen by 1 from then (a heap of those points). The charges are those
of charging every interval by the weights it started with (``fairgate.core.meter_reference`` does that, and
agrees to 1e-9).

Pure: the caller passes ``now_ms`` (any monotonic clock in ms).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from fairgate.core.cost import CostModel

# The most of an interval the other processes' prefill can take off it: a guard against a share summed
# from stale or overlapping rounds leaving this process's requests nothing (their prefill and decode run).
MAX_REMOTE_PREFILL_SHARE = 0.9

# The decode scales a meter takes (``set_decode_scale``; the gateway clamps the drift ratio to it). The ratio
# depends on when clients read their streams, and a scale away from the truth mis-splits every iteration that
# prefills (an outside tester: at 5, a 1,500-token prompt billed 30 % under and each decoder 113 % over; at
# 2, 10 % and 38 %); the drift check asks for a new calibration from 1.25, and a model off by more than 2x is
# no longer corrected, only reported.
DECODE_SCALE_RANGE = (0.5, 2.0)

# A prefill within this fraction of its time of being attributed counts as attributed. The integral and the
# per-interval definition round differently: an interval ending exactly where a prefill does (round numbers)
# must not leave the request prefilling by an ulp in one and for a whole further interval.
PREFILL_END_TOLERANCE = 1e-9


@dataclass
class _InFlight:
    tenant: str
    prompt_tokens: int
    prefill_ms: float  # the cost model's prefill time of its prompt
    prefilling: bool = True
    pending: bool = False  # sent, but the replica has not reached an iteration boundary since
    stopped: bool = False  # ``cut``, and the step it was cut in ended: no weight, a lender until the burst is over
    cut_ms: float = math.inf  # when its caller stopped it (``cut``)
    unseen_step: bool = False  # cut alone in its process beside others' requests: no token of its own ends its step
    sent_ms: float = 0.0
    joined_ms: float = -math.inf  # the token burst at which it joined the iteration (-inf: at its send)
    charged_ms: float = 0.0  # as of ``mark`` (the meter's price then)
    mark: float = 0.0
    weight: float = 0.0  # in the current iteration (0 while pending)
    prefill_end: float = math.inf  # the price at which its prefill will have been attributed
    sequences: int = 1  # OpenAI's ``n``: it holds that many places in the batch, its prompt prefilled once
    prefill_charged_ms: float = 0.0  # charged at its prefill weight, known once its prefill stops
    # Who ran beside it when its prefill stopped: its own decode weight, each tenant's other requests' weight,
    # and the other processes' sequences' weight (``MeteredCall``).
    beside: tuple[float, dict[str, float], float] | None = None
    prefill_repaid_ms: float = 0.0  # given back to it at its first token (``repaid_prefill``)
    prefill_done_ms: float = 0.0  # its prefill attributed, once it stopped (at most prefill_ms, and what was repaid)


@dataclass(frozen=True)
class BurstMark:
    """What a meter had at the first token of a burst (tokens less than ``boundary_lag_ms`` apart): its price
    integral so far (never reset; ms per unit of weight), its charges' total, and each request's charge less its
    prefill attributed (ms): what it was charged at its decode weight."""

    price_total: float
    charged_total_ms: float
    decode_ms: dict[str, float]


def repaid_prefill(
    owed_ms: float, weight: float, decode_weight: float, window_ms: float, window_price: float, accrued_ms: list[float]
) -> list[float]:
    """What each lender gives back to a request the meter left out of the iteration it was prefilled in.

    Over the window (that iteration, from the first token of the burst that began it) the requests were charged
    ``window_ms`` while the price rose ``window_price``: their average weight was ``window_ms / window_price``.
    Had the request weighed ``weight`` (its prefill and ``decode_weight``) in it, it would have been charged
    ``T w p / (T + w p)`` of those ``T`` ms: that, but at most its prefill not yet attributed (``owed_ms``) and one
    decode step's share (``decode_weight``: the window is one step; a share inflated by the prefill of another
    request late in the same burst took what that one is owed). Bounded by the window: a prompt the engine read
    from its prefix cache ended its iteration early, and moves only what that took. The lenders are the requests
    of the window: each gives in proportion to what it was charged there at its decode weight (``accrued_ms``),
    never more; a prefill, its own or another's, is charged the model's time either way.
    """
    total = sum(a for a in accrued_ms if a > 0.0)
    if owed_ms <= 0.0 or total <= 0.0 or window_price <= 0.0 or window_ms <= 0.0 or weight <= 0.0:
        return [0.0] * len(accrued_ms)
    share = window_ms * weight * window_price / (window_ms + weight * window_price)
    amount = min(share, owed_ms + decode_weight, total)
    return [amount * max(a, 0.0) / total for a in accrued_ms]


@dataclass(frozen=True)
class MeteredCall:
    """What the meter charged one request, as it left (``LiveMeter.leave``); ms and weights (ms per unit of the
    meter's price).

    Attributes:
        charged_ms: its whole charge.
        prefill_charged_ms: the part charged at its prefill weight, over the iterations it was prefilled in.
        prefill_weight: ``prefill_ms_per_token * prompt_tokens`` (the cost model's).
        decode_weight: its decode weight (``dt / B`` per sequence) when its prefill stopped.
        beside: tenant -> the weight of that tenant's other requests in the iteration then.
        remote_weight: the other gateway processes' sequences' weight then.
        tenant: its tenant.
    """

    charged_ms: float
    prefill_charged_ms: float = 0.0
    prefill_weight: float = 0.0
    decode_weight: float = 0.0
    beside: dict[str, float] = field(default_factory=dict)
    remote_weight: float = 0.0
    tenant: str = ""


@dataclass(frozen=True)
class Occupancy:
    """What a meter's requests held of its upstream's iterations over a window, time-averaged.

    ``sequences``: requests in the iteration (pending ones excluded); ``prefill_share``: prefill ms attributed
    to them per ms of the window (the share of the upstream's time spent prefilling them, 0-1)."""

    sequences: float = 0.0
    prefill_share: float = 0.0


class MeterWindow:
    """What every meter of one upstream keeps besides its requests: busy and charged time, the other
    processes' occupancy, and its own requests' occupancy over the current sharing window. ``LiveMeter``
    and the reference definition (``fairgate.core.meter_reference``) both build on it."""

    def __init__(self, cost: CostModel, now_ms: float, boundary_lag_ms: float | None = None) -> None:
        self.cost = cost
        self.boundary_lag_ms = cost.iter_base_ms / 2 if boundary_lag_ms is None else boundary_lag_ms
        self._last_ms = now_ms
        self.busy_ms = 0.0  # time with at least one of its requests in flight
        self.charged_total_ms = 0.0  # charged to its requests: busy_ms when no other process shares it
        self.remote = Occupancy()  # the other gateway processes' requests on the same replica
        self.decode_scale = 1.0  # observed / modelled decode step (``set_decode_scale``)
        # Nothing has come back from the upstream since it went idle: its first iteration has not ended.
        self.first_iteration = True
        self.burst_ms = -math.inf  # when the current burst's first token arrived: about when the running step began
        # The engine may take a request that reaches it just after a step's tokens into the next step
        # (``cut_in_running_step``): llama-server does; vLLM schedules that step before the tokens go out.
        self.admits_after_burst = True
        self._window_start_ms = now_ms
        self._sequence_ms = 0.0  # its own requests' occupancy since the window started: sequences x ms
        self._prefill_attributed_ms = 0.0  # and prefill ms attributed

    def _iteration_sequences(self) -> int:
        """Sequences of its requests in the iteration now (pending ones excluded)."""
        raise NotImplementedError

    def take_occupancy(self) -> Occupancy:
        """This meter's requests' occupancy, averaged from the last call (or the start) to the last
        ``advance``; starts a new window. Call ``advance`` first to include the time up to now. A window of
        no time gives the requests in the iteration now, and no prefill."""
        span = self._last_ms - self._window_start_ms
        if span > 0:  # the prefill's running sum may round a hair below 0
            taken = Occupancy(self._sequence_ms / span, min(1.0, max(0.0, self._prefill_attributed_ms / span)))
        else:
            taken = Occupancy(float(self._iteration_sequences()))
        self._window_start_ms = self._last_ms
        self._sequence_ms = self._prefill_attributed_ms = 0.0
        return taken


def joins_first_iteration(window: MeterWindow, sent_ms: float) -> bool:
    """Whether a request sent at ``sent_ms`` joins the iteration running at once: the upstream's first since it
    went idle, begun less than ``boundary_lag_ms`` before (``burst_ms``: the send that found it idle), and no
    other process's sequences keep it running. An idle engine takes in every request that reaches it before its
    first step starts (llama-server prefilled a request and seven sent 2 ms after it in one 1,345-ms step), and
    none that reaches it later: a request sent 100 ms into another's 1.3-s prefill was billed 78.7 ms of its
    own 67.5 as a share of that step (an outside tester). One the engine took after all has its first token
    with that step's, and is given its prefill back then (``first_token``)."""
    return (
        window.first_iteration and window.remote.sequences == 0 and sent_ms - window.burst_ms < window.boundary_lag_ms
    )


def cut_in_running_step(sent_ms: float, window: MeterWindow) -> bool:
    """Whether a request cut while pending, its prompt not prefilled, may be in the step the engine is running:
    it was sent less than ``boundary_lag_ms`` before that step's first token (``burst_ms``), or after it as
    closely where the engine takes such requests (``admits_after_burst``). Such a request is pending only because
    the meter cannot tell which side of the boundary it fell on; its first token would have said so
    (``first_token``). Not charged, a client that timed its hang-ups had long prompts prefilled for nothing (an
    outside tester: billed 0.61-0.67 of the replica's charge rule). A request sent later in the step waits for
    the next: aborting it costs nothing (an engine that schedules its next step before the tokens go out: 55 of 60
    requests cut 1-10 ms after their send just after a step's tokens never ran, and were billed 15 ms each)."""
    return sent_ms < window.burst_ms + (window.boundary_lag_ms if window.admits_after_burst else 0.0)


def check_decode_scale(scale: float) -> None:
    """Raises ``ValueError``: a decode scale outside ``DECODE_SCALE_RANGE``."""
    low, high = DECODE_SCALE_RANGE
    if not low <= scale <= high:
        raise ValueError(f"decode scale must be within {low}-{high}, got {scale}")


def check_remote(remote: Occupancy) -> None:
    """Raises ``ValueError``: a negative or non-finite sequence count, or a prefill share outside 0-1."""
    if not (0 <= remote.sequences < math.inf and 0 <= remote.prefill_share <= 1):
        raise ValueError(f"remote occupancy must be finite and >= 0, got {remote}")


class LiveMeter(MeterWindow):
    """Meters one upstream. Every event method first charges the interval since the last event
    (``advance``); ``charged_ms`` reads a request's charge so far."""

    def __init__(self, cost: CostModel, now_ms: float, boundary_lag_ms: float | None = None) -> None:
        super().__init__(cost, now_ms, boundary_lag_ms)
        self._requests: dict[str, _InFlight] = {}
        self._price = 0.0  # ms charged per unit of weight since the batch last changed
        self._own_weight = 0.0  # of its requests in the iteration
        self._remote_weight = 0.0  # of the other processes' sequences in it
        self._active_sequences = 0  # sequences of its requests in the iteration
        self._sequences = 0  # sequences of its requests in flight, pending ones included
        self._pending: dict[str, _InFlight] = {}  # the requests pending, in the order sent
        self._unprefilled = 0  # requests being prefilled, pending or not
        self._prefill_rate = 0.0  # prefill ms attributed per unit of price: prefill_ms of those in the iteration
        self._prefill_ends: list[tuple[float, str]] = []  # (prefill_end, request id), a heap
        self._price_total = 0.0  # the price integral, never reset (``BurstMark``)
        self._last_token_ms = -math.inf
        self._bursts: tuple[BurstMark | None, BurstMark | None] = (None, None)  # the previous burst's, the current's
        self._leaving: dict[str, _InFlight] = {}  # ``cut`` in the running step: they stop when it ends
        self._cut_pending: dict[str, _InFlight] = {}  # ``cut`` while pending for a later step
        self._stopped: dict[str, _InFlight] = {}  # and stopped: they leave when the burst that ended it is over
        self.departed: list[tuple[str, MeteredCall]] = []  # left since the caller last took them

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    @property
    def prefilling(self) -> bool:
        """Whether a request in flight is pending or being prefilled (the iteration is no plain decode step)."""
        return bool(self._pending) or self._unprefilled > 0

    @property
    def leaving(self) -> int:
        """Requests ``cut`` that have not left yet (``departed``)."""
        return len(self._leaving) + len(self._stopped) + len(self._cut_pending)

    @property
    def sequences(self) -> int:
        """Sequences of its requests in flight (a request of ``n`` counts ``n``)."""
        return self._sequences

    def charged_ms(self, request_id: str) -> float:
        """GPU ms charged to ``request_id`` up to the last event. Raises ``KeyError``: not in flight."""
        request = self._requests[request_id]
        return request.charged_ms + request.weight * (self._price - request.mark)

    def advance(self, now_ms: float) -> None:
        """Charge the interval since the last call to the requests in flight. A clock that went backwards
        charges nothing."""
        interval = now_ms - self._last_ms
        if interval <= 0:
            return
        self._last_ms = now_ms
        if self._stopped and now_ms - self.burst_ms >= self.boundary_lag_ms:
            self._depart_stopped()
        if not self._requests:
            return
        if self._own_weight <= 0:  # one is pending only beside an active one, or beside requests stopped
            self._boundary()
            if self._own_weight <= 0:  # only requests stopped: the engine runs none of them
                return
        self.busy_ms += interval
        own_weight = self._own_weight  # read into locals: this runs for every token relayed
        self._sequence_ms += self._active_sequences * interval
        # The others' prefill takes its share of the interval; the rest is split by weight, and the remote
        # sequences' part is theirs to charge.
        shared_ms = interval * (1.0 - min(self.remote.prefill_share, MAX_REMOTE_PREFILL_SHARE))
        own_ms = shared_ms * own_weight / (own_weight + self._remote_weight)
        self.charged_total_ms += own_ms
        rise = own_ms / own_weight
        self._price = price = self._price + rise
        self._price_total += rise
        if self._prefill_rate:  # none is prefilling in a plain decode step
            self._prefill_attributed_ms += self._prefill_rate * rise
        while self._prefill_ends and self._prefill_ends[0][0] <= price + PREFILL_END_TOLERANCE:
            end, request_id = heapq.heappop(self._prefill_ends)
            request = self._requests.get(request_id)
            if request is not None and request.prefilling and request.prefill_end == end:
                # Attributed within the interval just charged (at its prefill weight, as every interval is
                # charged by the weights it started with); from now it weighs as decode only.
                self._prefill_attributed_ms -= request.prefill_ms * (self._price - end)  # the overshoot (or rest)
                self._stop_prefilling(request)

    def _prefill_done_ms(self, request: _InFlight) -> float:
        """Its prefill attributed so far (none while pending; at most the model's, and what was repaid)."""
        if not request.prefilling:
            return request.prefill_done_ms
        return request.prefill_ms * min(1.0, max(0.0, 1.0 - (request.prefill_end - self._price)))

    def _stop_prefilling(self, request: _InFlight) -> None:
        self._bring_up_to_date(request)
        request.prefill_done_ms = self._prefill_done_ms(request) + request.prefill_repaid_ms
        request.prefilling = False
        self._unprefilled -= 1
        if not request.pending:
            self._note_prefill(request)
            self._prefill_rate -= request.prefill_ms
            request.weight -= request.prefill_ms
            self._own_weight -= request.prefill_ms

    def _note_prefill(self, request: _InFlight) -> None:
        """Keep what ``request`` was charged at its prefill weight (it joined at ``prefill_end - 1``; an interval
        that ran past the end was charged at that weight whole) and who ran beside it (O(in flight), once a
        request)."""
        attributed = request.prefill_ms * max(0.0, 1.0 - (request.prefill_end - self._price))
        request.prefill_charged_ms = attributed + request.prefill_repaid_ms
        beside: dict[str, float] = {}
        for other in self._requests.values():
            if other is not request and not other.pending:
                beside[other.tenant] = beside.get(other.tenant, 0.0) + other.weight
        request.beside = (request.weight - request.prefill_ms, beside, self._remote_weight)

    def _bring_up_to_date(self, request: _InFlight) -> None:
        request.charged_ms += request.weight * (self._price - request.mark)
        request.mark = self._price

    def _join(self, request_id: str, request: _InFlight, burst_ms: float = -math.inf) -> None:
        """``request`` joins the iteration (no longer pending) at the token burst of ``burst_ms`` (-inf: at
        its send); the caller reweighs."""
        self._bring_up_to_date(request)
        request.pending = False
        request.joined_ms = burst_ms
        del self._pending[request_id]
        self._active_sequences += request.sequences
        if request.prefilling:
            self._prefill_rate += request.prefill_ms
            request.prefill_end = self._price + 1.0
            heapq.heappush(self._prefill_ends, (request.prefill_end, request_id))

    def _reweigh(self) -> None:
        """The batch changed: every request's weight in the iteration from now (O(in flight)). Every charge
        is brought up to date, so the integral starts again from 0: it never grows large enough to lose
        precision, however long the upstream stays busy."""
        batch = self._active_sequences + self.remote.sequences
        step_ms = self.decode_scale * (self.cost.iter_base_ms + self.cost.iter_slope_ms * batch)
        decode = step_ms / batch if batch > 0 else 0.0
        own = rate = 0.0
        price, self._price = self._price, 0.0
        for request in self._requests.values():
            request.charged_ms += request.weight * (price - request.mark)
            request.mark = 0.0
            request.prefill_end -= price  # the same shift as its heap entry's: still equal
            prefill = request.prefill_ms if request.prefilling else 0.0
            # Each sequence weighs dt / B; a request of n sequences shares one prompt, prefilled once.
            out = request.pending or request.stopped
            request.weight = 0.0 if out else decode * request.sequences + prefill
            rate += 0.0 if out else prefill
            own += request.weight
        self._prefill_ends = [(end - price, rid) for end, rid in self._prefill_ends]  # a uniform shift: still a heap
        self._own_weight, self._remote_weight, self._prefill_rate = own, decode * self.remote.sequences, rate

    def _boundary(self, now_ms: float | None = None) -> None:
        """An iteration ended at ``now_ms``: the pending requests sent at least ``boundary_lag_ms`` before
        join the next one (all of them when ``now_ms`` is None)."""
        if not self._pending:
            return
        joined = []
        for rid, r in list(self._pending.items()):  # O(pending), not O(in flight), per token
            if rid in self._cut_pending:  # the engine took it into this step unless its abort came first
                del self._cut_pending[rid]
                if now_ms is not None and now_ms - r.cut_ms >= self.boundary_lag_ms:
                    self.departed.append((rid, self._leave(rid, r)))
                    continue
                self._leaving[rid] = r
                joined.append((rid, r))
            elif now_ms is None or now_ms - r.sent_ms >= self.boundary_lag_ms:
                joined.append((rid, r))
        for rid, request in joined:
            self._join(rid, request, -math.inf if now_ms is None else now_ms)
        if joined:
            self._reweigh()

    def _note_burst(self, now_ms: float) -> bool:
        """A token arrived: the first of a burst marks every charge (O(in flight) once an iteration; the rest of
        the burst's tokens are O(1)). Returns whether it was the first."""
        first = now_ms - self._last_token_ms >= self.boundary_lag_ms
        if first:
            price, done = self._price, self._prefill_done_ms
            decode = {
                rid: r.charged_ms + r.weight * (price - r.mark) - (done(r) if r.prefilling else r.prefill_done_ms)
                for rid, r in self._requests.items()
            }
            self._bursts = (self._bursts[1], BurstMark(self._price_total, self.charged_total_ms, decode))
            self.burst_ms = now_ms
        self._last_token_ms = now_ms
        return first

    def _repay_prefill(self, request_id: str, request: _InFlight, window: BurstMark | None, step_over: bool) -> None:
        """``request`` was prefilled in the iteration of ``window`` (from a burst's first token: the one before its
        first token's burst, or the current one for a request cut in it), which the meter charged to the others:
        they give back its part of it (``repaid_prefill``; O(in flight), once a request at most). Its decode share
        of the step is part of it when the ``step_over``; cut in the step, it is charged that share to its end."""
        owed_ms = request.prefill_ms * min(1.0, max(0.0, request.prefill_end - self._price))
        if window is None or owed_ms <= PREFILL_END_TOLERANCE * request.prefill_ms:
            return
        lenders = [
            (other, window.decode_ms[rid])
            for rid, other in self._requests.items()
            if rid != request_id and rid in window.decode_ms
        ]
        for other, _ in lenders:
            self._bring_up_to_date(other)
        accrued = [other.charged_ms - self._prefill_done_ms(other) - before for other, before in lenders]
        window_ms, window_price = (
            self.charged_total_ms - window.charged_total_ms,
            self._price_total - window.price_total,
        )
        decode = request.weight - request.prefill_ms if step_over else 0.0
        takes = repaid_prefill(owed_ms, request.weight, decode, window_ms, window_price, accrued)
        for (other, _), take in zip(lenders, takes, strict=True):
            other.charged_ms -= take
        repaid = sum(takes)
        request.charged_ms += repaid
        self._prefill_attributed_ms += repaid
        if step_over:  # it stops prefilling now
            request.prefill_repaid_ms = repaid
        elif repaid > 0.0:  # it goes on prefilling, what it paid of its prefill attributed (never lent on)
            request.prefill_end -= repaid / request.prefill_ms
            heapq.heappush(self._prefill_ends, (request.prefill_end, request_id))

    def _iteration_sequences(self) -> int:
        return self._active_sequences

    def set_remote(self, remote: Occupancy, now_ms: float) -> None:
        """From ``now_ms`` the other processes hold ``remote`` of the upstream (see module docstring); the
        interval that ended now is charged with the previous remote occupancy.

        Raises:
            ValueError: a negative or non-finite count, or a prefill share outside 0-1.
        """
        check_remote(remote)
        self.advance(now_ms)
        changed = remote.sequences != self.remote.sequences
        self.remote = remote
        if changed:
            self._reweigh()

    def set_decode_scale(self, scale: float, now_ms: float) -> None:
        """From ``now_ms`` a decode step weighs ``scale`` times the cost model's (see module docstring); the
        interval that ended now is charged with the previous scale. Raises ``ValueError``: outside
        ``DECODE_SCALE_RANGE``."""
        check_decode_scale(scale)
        self.advance(now_ms)
        if scale != self.decode_scale:
            self.decode_scale = scale
            self._reweigh()

    def start(self, request_id: str, tenant: str, prompt_tokens: int, now_ms: float, sequences: int = 1) -> None:
        """``request_id`` was sent upstream, running ``sequences`` (OpenAI's ``n``)."""
        self.advance(now_ms)
        assert request_id not in self._requests, f"request {request_id} metered twice"
        prefill_ms = self.cost.prefill_ms(prompt_tokens)
        request = _InFlight(tenant, prompt_tokens, prefill_ms, prefilling=prefill_ms > 0, pending=True)
        request.sent_ms, request.sequences, request.mark = now_ms, sequences, self._price
        if not self._requests:  # idle: its first iteration begins, marked as a burst would (``first_token``)
            self.burst_ms, self._bursts = now_ms, (None, BurstMark(self._price_total, self.charged_total_ms, {}))
        self._requests[request_id] = request
        self._sequences += sequences
        self._pending[request_id] = request
        self._unprefilled += request.prefilling
        first = joins_first_iteration(self, now_ms)
        if self._active_sequences == 0 or first:
            self._join(request_id, request)
            self._reweigh()
            if first and self._bursts[1] is not None:  # a lender to a request late for that iteration
                self._bursts[1].decode_ms[request_id] = 0.0

    def first_token(self, request_id: str, now_ms: float) -> None:
        """Its first token arrived: an iteration ended, and its prefill is over. Had the meter put it in a later
        iteration than the one it was prefilled in (pending still, or joined in this burst), the requests beside
        it were charged its prefill, and they give it back (see module docstring)."""
        self.advance(now_ms)
        self.first_iteration = False
        request = self._requests.get(request_id)
        step_ended = self._note_burst(now_ms)
        if request is not None:
            late = request.pending or now_ms - request.joined_ms < self.boundary_lag_ms
            if request.pending:
                self._join(request_id, request, now_ms)
                self._reweigh()
            if request.prefilling:
                if late:
                    self._bring_up_to_date(request)
                    self._repay_prefill(request_id, request, self._bursts[0], step_over=True)
                self._stop_prefilling(request)
        if step_ended and self._leaving:
            self._stop_leaving(now_ms)
        self._boundary(now_ms)

    def token(self, now_ms: float) -> None:
        """A later token of some request arrived: an iteration ended."""
        self.advance(now_ms)
        self.first_iteration = False
        if self._note_burst(now_ms) and self._leaving:
            self._stop_leaving(now_ms)
        if self._pending:  # asked here: this runs for every token relayed
            self._boundary(now_ms)

    def finish(self, request_id: str, now_ms: float) -> float:
        """It left the upstream (done or failed). Returns its total charge (ms)."""
        return self.leave(request_id, now_ms).charged_ms

    def leave(self, request_id: str, now_ms: float) -> MeteredCall:
        """It left the upstream (done or failed): what it was charged, and how. A request cut by its caller
        leaves by ``cut``."""
        self.advance(now_ms)
        return self._leave(request_id, self._requests[request_id])

    def cut(self, request_id: str, now_ms: float) -> MeteredCall | None:
        """Its caller stopped it (the client left, a deadline) while the upstream had it. An engine takes an abort
        between steps (vLLM, llama.cpp; the emulated replica too): a request in the running step stays in it, and
        is charged, until the step ends - the first burst ``boundary_lag_ms`` or more after the cut (closer, the
        abort may have reached the engine after it took the request into the next step), or ``depart`` when the
        caller's clock says the step is over. One pending that may be in the running step
        (``cut_in_running_step``) joins it as at its first token; one pending for a later step leaves when that
        step starts, or joins it on the same terms. One alone in this process beside other processes' requests,
        whose step no token of its own can end, leaves by ``leave_after_ms``. Returns None: it leaves later
        (``departed``, ``depart``)."""
        self.advance(now_ms)
        request = self._requests[request_id]
        request.cut_ms = now_ms
        if request.pending:
            if not (request.prefilling and cut_in_running_step(request.sent_ms, self)):
                # Pending for a later step: it leaves at that step's start, or joins that step if its abort may
                # have reached the engine after it (``_boundary``; an outside tester cut requests 1 ms before it).
                self._cut_pending[request_id] = request
                return None
            self._join(request_id, request, now_ms)
            self._reweigh()
            self._bring_up_to_date(request)
            self._repay_prefill(request_id, request, self._bursts[1], step_over=False)
        else:  # no token of this process's can end its step, which other processes' requests share
            request.unseen_step = self.remote.sequences > 0 and self._sequences_not_cut() == request.sequences
        self._leaving[request_id] = request
        return None

    def leave_after_ms(self, request_id: str) -> float:
        """How long after its ``cut`` a request is to leave when no token ends its step first (``depart``), in ms:
        what is left of the step by the cost model (``step_left_ms``). For one alone in its process beside other
        processes' requests, whose steps it cannot see, that times the chance that the replica took it in before
        its abort came: its time from send to cut over a decode step, at most 1. Billed the whole step, quick
        cancels there paid 2.02 of the replica's charge rule (most never ran); let go at the cut, prompts cut
        30-300 ms after their send paid 0.69, the other process's tenants 1.30 (outside testers). Raises
        ``KeyError``: not in flight."""
        request, left = self._requests[request_id], self.step_left_ms()
        if not request.unseen_step:
            return left
        decode_ms = self.decode_scale * (self.cost.iter_base_ms + self.cost.iter_slope_ms * (1 + self.remote.sequences))
        # The replica's mean step is longer than a decode step by the others' prefill: of a window of N steps,
        # prefill_share = P / (N * decode_ms + P), so the mean step is decode_ms / (1 - prefill_share).
        step_ms = decode_ms / (1.0 - min(self.remote.prefill_share, MAX_REMOTE_PREFILL_SHARE))
        return left * min(1.0, (request.cut_ms - request.sent_ms) / step_ms)

    def _sequences_not_cut(self) -> int:
        """Sequences of this process's requests in the iteration not cut (O(leaving)): their tokens end steps."""
        return self._active_sequences - sum(r.sequences for r in self._leaving.values())

    def depart(self, request_id: str, now_ms: float) -> MeteredCall:
        """A request ``cut`` leaves at ``now_ms``, whatever the tokens said (the caller's deadline:
        ``leave_after_ms``). Raises ``KeyError``: not leaving, or gone already (``departed``)."""
        self.advance(now_ms)
        request = self._leaving.pop(request_id, None) or self._stopped.pop(request_id, None)
        return self._leave(request_id, request or self._cut_pending.pop(request_id))

    def step_left_ms(self) -> float:
        """What is left of the running step by the cost model (ms): the prefill not yet attributed of every request
        in it, and a decode step (O(in flight)). A request ``cut`` in it leaves by then (``depart``) when no token
        ends it sooner (``tokens_will_end_step``)."""
        owed = sum(
            r.prefill_ms * min(1.0, max(0.0, r.prefill_end - self._price))
            for r in self._requests.values()
            if r.prefilling and not r.pending
        )
        batch = self._active_sequences + self.remote.sequences
        return owed + self.decode_scale * (self.cost.iter_base_ms + self.cost.iter_slope_ms * batch)

    def in_step(self, request_id: str) -> bool:
        """Whether ``request_id``, ``cut``, is still in the step it was cut in (not stopped, not gone)."""
        return request_id in self._leaving

    @property
    def tokens_will_end_step(self) -> bool:
        """Whether a request of this process not cut runs in the iteration: its next token will end the step."""
        return self._sequences_not_cut() > 0

    def _stop_leaving(self, now_ms: float) -> None:
        """A step ended at ``now_ms``: the requests cut at least ``boundary_lag_ms`` before weigh nothing from now,
        and stay until the burst is over only to give back a late request's prefill (``_repay_prefill``): its first
        token may be read after the token that ended the step. One cut closer to the step's end stays for the next
        step: its abort may have reached the engine after the engine took it into that step (an outside tester cut
        long prompts 1 ms before a boundary, which the engine then prefilled: billed 0.29-0.55 of the charge rule)."""
        stopping = {rid: r for rid, r in self._leaving.items() if now_ms - r.cut_ms >= self.boundary_lag_ms}
        for request_id, request in stopping.items():
            if request.prefilling:
                self._stop_prefilling(request)
            self._bring_up_to_date(request)
            request.stopped = True
            self._active_sequences -= request.sequences
            del self._leaving[request_id]
        self._stopped.update(stopping)
        if stopping:
            self._reweigh()

    def _depart_stopped(self) -> None:
        for request_id, request in list(self._stopped.items()):
            self.departed.append((request_id, self._leave(request_id, request)))
        self._stopped.clear()

    def _leave(self, request_id: str, request: _InFlight) -> MeteredCall:
        self._bring_up_to_date(request)
        if request.prefilling and not request.pending:
            self._note_prefill(request)
        del self._requests[request_id]
        self._sequences -= request.sequences
        self._unprefilled -= request.prefilling
        if request.pending:
            del self._pending[request_id]
        elif not request.stopped:
            self._active_sequences -= request.sequences
            self._prefill_rate -= request.prefill_ms if request.prefilling else 0.0
        # No boundary: a request that ends has had its last token (that was one), and a deadline is no token (an
        # outside tester hung up on a request of its own to make another, pending, join early and leave its
        # prefill mostly unattributed).
        self._reweigh()
        if not self._requests:  # idle: no prefill will end, and the next request starts a first iteration
            self._prefill_ends.clear()
            self.first_iteration = True
        if request.beside is None:  # never prefilled in an iteration of its own (pending to the end, or no prompt)
            return MeteredCall(request.charged_ms, tenant=request.tenant)
        decode, beside, remote = request.beside
        return MeteredCall(
            request.charged_ms, request.prefill_charged_ms, request.prefill_ms, decode, beside, remote, request.tenant
        )
