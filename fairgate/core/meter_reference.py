"""The live meter by its definition: every interval charged to every request in flight, by the weights the
interval started with (O(in flight) per event). ``fairgate.core.meter.LiveMeter`` keeps one integral instead
(O(1) per token) and must agree with it event by event (tests/core/test_meter.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fairgate.core.cost import CostModel
from fairgate.core.meter import (
    MAX_REMOTE_PREFILL_SHARE,
    PREFILL_END_TOLERANCE,
    BurstMark,
    MeterWindow,
    Occupancy,
    check_decode_scale,
    check_remote,
    cut_in_running_step,
    joins_first_iteration,
    repaid_prefill,
)


@dataclass
class _InFlight:
    tenant: str
    prompt_tokens: int
    prefill_left_ms: float  # the cost model's prefill time not yet attributed to it
    prefilling: bool = True
    pending: bool = False  # sent, but the replica has not reached an iteration boundary since
    stopped: bool = False  # ``cut``, and the step it was cut in ended (``LiveMeter``)
    cut_ms: float = math.inf  # when its caller stopped it
    sent_ms: float = 0.0
    joined_ms: float = -math.inf  # the token burst at which it joined the iteration (-inf: at its send)
    charged_ms: float = 0.0
    sequences: int = 1  # OpenAI's ``n``: it holds that many places in the batch, its prompt prefilled once
    prefill_done_ms: float = 0.0  # its prefill attributed (and given back: ``repaid_prefill``)


@dataclass(frozen=True)
class MeterCharge:
    """GPU ms charged to one request for the interval just metered."""

    request_id: str
    tenant: str
    gpu_ms: float


class ReferenceMeter(MeterWindow):
    """Meters one upstream. Call ``advance(now_ms)`` before every change (the methods below do it)."""

    def __init__(self, cost: CostModel, now_ms: float, boundary_lag_ms: float | None = None) -> None:
        super().__init__(cost, now_ms, boundary_lag_ms)
        self._requests: dict[str, _InFlight] = {}
        self._price_total = 0.0  # ms charged per unit of weight, summed over every interval
        self._last_token_ms = -math.inf
        self._bursts: tuple[BurstMark | None, BurstMark | None] = (None, None)  # the previous burst's, the current's
        self._leaving: set[str] = set()  # ``cut`` in the running step: they stop when it ends
        self._cut_pending: set[str] = set()  # ``cut`` while pending for a later step
        self._stopped: set[str] = set()  # and stopped: they leave when the burst that ended it is over
        self.departed: list[tuple[str, float]] = []  # (request id, total charge) left at a step's end

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    @property
    def prefilling(self) -> bool:
        """Whether a request in flight is pending or being prefilled (the iteration is no plain decode step)."""
        return any(r.prefilling or r.pending for r in self._requests.values())

    @property
    def leaving(self) -> int:
        """Requests ``cut`` that have not left yet (``departed``)."""
        return len(self._leaving) + len(self._stopped) + len(self._cut_pending)

    @property
    def sequences(self) -> int:
        """Sequences of its requests in flight (a request of ``n`` counts ``n``)."""
        return sum(r.sequences for r in self._requests.values())

    def _weights(self) -> tuple[dict[str, float], float]:
        """Weights of this process's requests in the current iteration (the pending ones are not in it), and
        the weight of the other processes' (``remote``) in it."""
        active = {rid: r for rid, r in self._requests.items() if not (r.pending or r.stopped)}
        if not active:
            return {}, 0.0
        batch = sum(r.sequences for r in active.values()) + self.remote.sequences
        decode = self.decode_scale * (self.cost.iter_base_ms + self.cost.iter_slope_ms * batch) / batch
        # Each sequence weighs dt / B; a request of n sequences shares one prompt, prefilled once.
        weights = {
            rid: decode * r.sequences + (self.cost.prefill_ms(r.prompt_tokens) if r.prefilling else 0.0)
            for rid, r in active.items()
        }
        return weights, decode * self.remote.sequences

    def _boundary(self, now_ms: float | None = None) -> None:
        """An iteration ended at ``now_ms``: the pending requests sent at least ``boundary_lag_ms`` before
        join the next one (all of them when ``now_ms`` is None)."""
        for rid, request in list(self._requests.items()):
            if not request.pending:
                continue
            if rid in self._cut_pending:  # ``LiveMeter._boundary``
                self._cut_pending.remove(rid)
                if now_ms is not None and now_ms - request.cut_ms >= self.boundary_lag_ms:
                    self.departed.append((rid, self._leave(rid)))
                    continue
                self._leaving.add(rid)
            elif not (now_ms is None or now_ms - request.sent_ms >= self.boundary_lag_ms):
                continue
            request.pending = False
            request.joined_ms = -math.inf if now_ms is None else now_ms

    def advance(self, now_ms: float) -> list[MeterCharge]:
        """Charge the interval since the last call to the requests in flight. A clock that went backwards
        charges nothing."""
        interval = now_ms - self._last_ms
        if interval <= 0:
            return []
        self._last_ms = now_ms
        if self._stopped and now_ms - self.burst_ms >= self.boundary_lag_ms:
            self._depart_stopped()
        if not self._requests:
            return []
        weights, remote_weight = self._weights()
        if not weights:  # one is pending only beside an active one, or beside requests stopped
            self._boundary()
            weights, remote_weight = self._weights()
            if not weights:  # only requests stopped: the engine runs none of them
                return []
        self.busy_ms += interval
        own_weight = sum(weights.values())
        self._sequence_ms += sum(self._requests[rid].sequences for rid in weights) * interval
        # The others' prefill takes its share of the interval; the rest is split by weight, and the remote
        # sequences' part is theirs to charge.
        shared_ms = interval * (1.0 - min(self.remote.prefill_share, MAX_REMOTE_PREFILL_SHARE))
        own_ms = shared_ms * own_weight / (own_weight + remote_weight)
        self.charged_total_ms += own_ms
        self._price_total += own_ms / own_weight
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
                prefill_ms = self.cost.prefill_ms(request.prompt_tokens)
                prefill_part = share * prefill_ms / weight
                if request.prefill_left_ms - prefill_part <= PREFILL_END_TOLERANCE * prefill_ms:
                    self._prefill_attributed_ms += request.prefill_left_ms  # all of it: attributed
                    request.prefill_done_ms += request.prefill_left_ms
                    request.prefill_left_ms = 0.0
                    request.prefilling = False
                else:
                    self._prefill_attributed_ms += prefill_part
                    request.prefill_done_ms += prefill_part
                    request.prefill_left_ms -= prefill_part
            charges.append(MeterCharge(rid, request.tenant, share))
        return charges

    def _iteration_sequences(self) -> int:
        return sum(r.sequences for r in self._requests.values() if not (r.pending or r.stopped))

    def set_remote(self, remote: Occupancy, now_ms: float) -> list[MeterCharge]:
        """From ``now_ms`` the other processes hold ``remote`` of the upstream (see module docstring).
        Returns the charges of the interval that ended now (split with the previous remote occupancy).

        Raises:
            ValueError: a negative or non-finite count, or a prefill share outside 0-1.
        """
        check_remote(remote)
        charges = self.advance(now_ms)
        self.remote = remote
        return charges

    def set_decode_scale(self, scale: float, now_ms: float) -> list[MeterCharge]:
        """From ``now_ms`` a decode step weighs ``scale`` times the cost model's. Returns the charges of the
        interval that ended now (at the previous scale). Raises ``ValueError``: outside
        ``DECODE_SCALE_RANGE``."""
        check_decode_scale(scale)
        charges = self.advance(now_ms)
        self.decode_scale = scale
        return charges

    def start(
        self, request_id: str, tenant: str, prompt_tokens: int, now_ms: float, sequences: int = 1
    ) -> list[MeterCharge]:
        """``request_id`` was sent upstream, running ``sequences`` (OpenAI's ``n``). Returns the charges of
        the interval that ended now."""
        charges = self.advance(now_ms)
        assert request_id not in self._requests, f"request {request_id} metered twice"
        prefill_ms = self.cost.prefill_ms(prompt_tokens)
        if not self._requests:  # idle: its first iteration begins (``LiveMeter.start``)
            self.burst_ms, self._bursts = now_ms, (None, BurstMark(self._price_total, self.charged_total_ms, {}))
        first = joins_first_iteration(self, now_ms)
        busy = any(not (r.pending or r.stopped) for r in self._requests.values()) and not first
        if first and self._bursts[1] is not None:
            self._bursts[1].decode_ms[request_id] = 0.0
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
        """Its first token arrived: an iteration ended, and its prefill is over; if it was pending or joined in
        this same burst, it is given back what of its prefill the others were charged (``LiveMeter.first_token``).
        Returns the interval's charges and those moves."""
        charges = self.advance(now_ms)
        self.first_iteration = False
        request = self._requests.get(request_id)
        step_ended = self._note_burst(now_ms)
        if request is not None:
            # Prefilled in the iteration that ended, which the meter charged to the others.
            late = request.pending or now_ms - request.joined_ms < self.boundary_lag_ms
            if request.pending:
                request.pending, request.joined_ms = False, now_ms
            if request.prefilling:
                if late:
                    charges += self._repay_prefill(request_id, self._bursts[0], step_over=True)
                request.prefilling, request.prefill_left_ms = False, 0.0
        if step_ended:
            self._stop_leaving(now_ms)
        self._boundary(now_ms)
        return charges

    def _note_burst(self, now_ms: float) -> bool:
        """The first token of a burst marks every charge (``LiveMeter._note_burst``); returns whether it was."""
        first = now_ms - self._last_token_ms >= self.boundary_lag_ms
        if first:
            decode = {rid: r.charged_ms - r.prefill_done_ms for rid, r in self._requests.items()}
            self._bursts = (self._bursts[1], BurstMark(self._price_total, self.charged_total_ms, decode))
            self.burst_ms = now_ms
        self._last_token_ms = now_ms
        return first

    def _repay_prefill(self, request_id: str, window: BurstMark | None, step_over: bool) -> list[MeterCharge]:
        """What the requests charged for the iteration ``request_id`` was prefilled in (from ``window``) give back
        of it (``LiveMeter._repay_prefill``). Returns the moves."""
        request = self._requests[request_id]
        if window is None:
            return []
        lenders = [rid for rid in self._requests if rid != request_id and rid in window.decode_ms]
        accrued = [
            self._requests[rid].charged_ms - self._requests[rid].prefill_done_ms - window.decode_ms[rid]
            for rid in lenders
        ]
        weight = self._weights()[0][request_id]
        decode = weight - self.cost.prefill_ms(request.prompt_tokens) if step_over else 0.0
        window_ms, window_price = (
            self.charged_total_ms - window.charged_total_ms,
            self._price_total - window.price_total,
        )
        takes = repaid_prefill(request.prefill_left_ms, weight, decode, window_ms, window_price, accrued)
        moves = [MeterCharge(request_id, request.tenant, sum(takes))]
        for rid, take in zip(lenders, takes, strict=True):
            self._requests[rid].charged_ms -= take
            moves.append(MeterCharge(rid, self._requests[rid].tenant, -take))
        request.charged_ms += sum(takes)
        request.prefill_done_ms += sum(takes)
        self._prefill_attributed_ms += sum(takes)
        if not step_over:  # it goes on prefilling: what it paid of its prefill is attributed
            request.prefill_left_ms -= sum(takes)
        return moves

    def token(self, now_ms: float) -> list[MeterCharge]:
        """A later token of some request arrived: an iteration ended. Returns the interval's charges."""
        charges = self.advance(now_ms)
        self.first_iteration = False
        if self._note_burst(now_ms):
            self._stop_leaving(now_ms)
        self._boundary(now_ms)
        return charges

    def finish(self, request_id: str, now_ms: float) -> tuple[list[MeterCharge], float]:
        """It left the upstream (done or failed). Returns the interval's charges and its total."""
        charges = self.advance(now_ms)
        return charges, self._leave(request_id)

    def cut(self, request_id: str, now_ms: float) -> tuple[list[MeterCharge], float | None]:
        """Its caller stopped it (``LiveMeter.cut``). Returns the interval's charges (and the moves of a request
        pending in the running step, which joins it), and its total if it leaves now, else None."""
        charges = self.advance(now_ms)
        request = self._requests[request_id]
        request.cut_ms = now_ms
        if request.pending:
            if not (request.prefilling and cut_in_running_step(request.sent_ms, self)):
                self._cut_pending.add(request_id)
                return charges, None
            request.pending, request.joined_ms = False, now_ms
            charges += self._repay_prefill(request_id, self._bursts[1], step_over=False)
        self._leaving.add(request_id)
        return charges, None

    def depart(self, request_id: str, now_ms: float) -> tuple[list[MeterCharge], float]:
        """A request ``cut`` in a step leaves it at ``now_ms`` (``LiveMeter.depart``). Raises ``KeyError``: not
        leaving."""
        charges = self.advance(now_ms)
        for cut in (self._leaving, self._stopped, self._cut_pending):
            if request_id in cut:
                cut.remove(request_id)
                break
        else:
            raise KeyError(request_id)
        return charges, self._leave(request_id)

    def _stop_leaving(self, now_ms: float) -> None:
        """The requests cut at least ``boundary_lag_ms`` before the step that ended now stop (``LiveMeter``)."""
        stopping = {rid for rid in self._leaving if now_ms - self._requests[rid].cut_ms >= self.boundary_lag_ms}
        for request_id in stopping:
            request = self._requests[request_id]
            request.stopped, request.prefilling, request.prefill_left_ms = True, False, 0.0
        self._stopped |= stopping
        self._leaving -= stopping

    def _depart_stopped(self) -> None:
        self.departed += [(request_id, self._leave(request_id)) for request_id in sorted(self._stopped)]
        self._stopped.clear()

    def _leave(self, request_id: str) -> float:
        request = self._requests.pop(request_id)
        self.first_iteration = self.first_iteration or not self._requests
        return request.charged_ms

    def charged_ms(self, request_id: str) -> float:
        """GPU ms charged to ``request_id`` so far."""
        return self._requests[request_id].charged_ms
