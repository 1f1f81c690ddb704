"""Counter-based fair policies: VTC, VTC with a calibrated output weight, and GPU-time fairness.

All three keep one counter per tenant, admit the backlogged tenant with the lowest counter, and lift
a tenant that returns from idle to the lowest counter among the other active tenants, so idle time is
not banked (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024, Algorithm 2: the
"virtual token counter" with counter lift). "Active" means queued or running; when no other tenant is
active, the floor is the counter of the last tenant to go idle.

A tenant whose queue empties while its requests still run got every slot it asked for; with weights,
its counter then grows more slowly than its neighbours' for the same use (a weight-2 tenant's half as
fast), and the difference would be banked and spent the moment capacity runs short (a weight-2 tenant
took 3-7x its weight-1 neighbour's GPU for ~30 s after a replica was lost: ``fairgate drill capacity``).
So when its next request arrives to the empty queue, its key (the counter, plus committed work where a
policy counts it) is lifted towards the *virtual time*: the highest key any pick has been made at, as
start-time fair queuing starts a flow that becomes backlogged at the larger of the virtual time and its
previous packet's finish tag (Goyal, Vin, Cheng, SIGCOMM 1996). Its requests still running are that
previous packet, of unknown size: the key is lifted to the virtual time less an allowance for their work
not yet charged - each running request counted at the tenant's mean charge per finished request (the mean
residual of a memoryless length) - and not at all before one of its requests has finished. Without the
allowance, the lift charged the running work twice (seed 002's study moved from 1.00 to 1.01).
They differ only in what a unit of work adds:

- ``vtc``: ``input_weight * prompt tokens + output_weight * generated tokens`` (shipped weights 1 and 2);
- ``vtc_calibrated``: the output weight is the cost model's exchange rate at the batch size the token
  was generated at (seed 002: 15.42 at B=24, 27.92 at B=8);
- ``gpu_fair``: the GPU ms actually charged: ``dt / B`` per running sequence per iteration, plus the
  sequence's own prefill (seed 002, "charge dt / B as it is spent").

Each increment is divided by the tenant's ``weight``, so tenants receive shares proportional to their
weights (weighted fair queuing, Demers, Keshav, Shenker, SIGCOMM 1989).

Counters within ``TIE_RELATIVE`` of the lowest are treated as equal and the tie goes to the tenant whose
head request arrived first: float sums of the same charges taken in a different order then make the
same decision.
"""

from __future__ import annotations

from collections.abc import Mapping

from fairgate.core.cost import CostModel
from fairgate.core.policy import QueuedPolicy
from fairgate.core.request import Request, RunningView

TIE_RELATIVE = 1e-9


class CounterPolicy(QueuedPolicy):
    """Lowest-counter-first with counter lift (see module docstring). Subclasses define ``_cost``.

    Args:
        weights: tenant -> weight (> 0); absent tenants weigh 1.
    """

    name = "counter"

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        super().__init__()
        self._weights: dict[str, float] = {}
        self.reweight(weights or {})
        self.counters: dict[str, float] = {}
        self._tracked: set[str] = set()  # tenants seen so far
        self._last_left = 0.0  # counter of the last tenant to go idle (the lift floor when none is active)
        self.virtual_time = 0.0  # the highest key a pick has been made at (see module docstring)
        self._charged: dict[str, float] = {}  # counter growth by work (not by lifts), per tenant
        self._finished: dict[str, int] = {}  # requests that left their slot, per tenant

    @property
    def weights(self) -> dict[str, float]:
        """Tenant -> the weight its charges are divided by now (absent: 1); a copy."""
        return dict(self._weights)

    def reweight(self, weights: Mapping[str, float]) -> None:
        """Divide what each tenant is charged from now on by its weight in ``weights`` (absent: 1). A counter
        keeps what it accrued: the service already weighed stands, as a WFQ flow's virtual finish times do
        when its weight changes. Raises ``ValueError``: a weight <= 0 (nothing changed)."""
        for tenant, weight in weights.items():
            if not weight > 0:
                raise ValueError(f"weight of tenant {tenant!r} must be > 0, got {weight}")
        self._weights = dict(weights)

    def _active(self, tenant: str) -> bool:
        return tenant in self._queues or self._running(tenant) > 0

    def _key(self, tenant: str) -> float:
        """What picks compare: the counter (subclasses add committed work)."""
        return self.counters.get(tenant, 0.0)

    def _on_backlogged(self, tenant: str, now_ms: float) -> None:
        running = self._running(tenant)
        if running:
            # It got every slot it asked for: lift its key towards the virtual time, so the share it left
            # unused is not banked, less an allowance for its running work (see module docstring).
            finished = self._finished.get(tenant, 0)
            if not finished:
                return
            floor = self.virtual_time - running * self._charged.get(tenant, 0.0) / finished
            key = self._key(tenant)
            if key < floor:
                self.counters[tenant] = self.counters.get(tenant, 0.0) + floor - key
            return
        others = [self.counters.get(t, 0.0) for t in self._tracked if t != tenant and self._active(t)]
        floor = min(others) if others else self._last_left
        if self.counters.get(tenant, 0.0) < floor:
            self.counters[tenant] = floor
        self._tracked.add(tenant)

    def _on_inactive(self, tenant: str, now_ms: float) -> None:
        self._last_left = self.counters.get(tenant, 0.0)

    def _commit(self, request: Request) -> None:
        """``request``, picked, declared ``max_output_tokens``: count it as committed work where a subclass does."""
        return None

    def pick(self, now_ms: float, running: RunningView) -> Request | None:
        # ``QueuedPolicy.pick`` with the choice (lowest key, ties to the earliest head) and the virtual time's
        # update written out: a simulation picks at nearly every scheduling event, so each call in between counts
        queues = self._queues
        if not queues:
            return None
        keys = self._keys()
        lowest = min(keys)
        limit = lowest + TIE_RELATIVE * max(1.0, abs(lowest))
        if len(keys) == 1 or sorted(keys)[1] > limit:
            tenant, key = list(queues)[keys.index(lowest)], lowest  # ``lowest`` is ``_key(tenant)``, as computed
        else:
            tied = [t for t, k in zip(queues, keys, strict=False) if k <= limit]
            earliest = tied[0] if len(tied) == 1 else self._earliest(tied)
            assert earliest is not None  # ``tied`` holds the lowest key's tenant at least
            tenant, key = earliest, self._key(earliest)
        queue = queues[tenant]
        request = queue.popleft()
        self._queued -= 1
        if not queue:
            del queues[tenant]
            self._on_idle(tenant, now_ms)
        self._in_flight[tenant] = self._in_flight.get(tenant, 0) + 1
        if key > self.virtual_time:  # ``max(virtual_time, key)``
            self.virtual_time = key
        if request.max_output_tokens:
            self._commit(request)
        return request

    def _keys(self) -> list[float]:
        """``_key`` of every queued tenant, in queue order (one pass: picks read them all)."""
        counters = self.counters
        return [counters.get(t, 0.0) for t in self._queues]

    def charge(
        self, tenant: str, gpu_ms: float, input_tokens: int, output_tokens: int, batch_size: int, remote: bool = False
    ) -> None:
        cost = self._cost(gpu_ms, input_tokens, output_tokens, batch_size)
        if cost:
            weighted = cost / self._weights.get(tenant, 1.0)
            self.counters[tenant] = self.counters.get(tenant, 0.0) + weighted
            if not remote:  # the mean charge per request of this policy's own finished requests
                self._charged[tenant] = self._charged.get(tenant, 0.0) + weighted

    def charge_decode(self, batch: Mapping[str, int], iterations: int, per_sequence_ms: float, batch_size: int) -> None:
        # ``charge`` for each tenant, written out: once per scheduling event of a simulation
        cost_of, counters, charged, weights = self._cost, self.counters, self._charged, self._weights
        unit = self._decode_unit(batch_size)
        for tenant, running in batch.items():
            tokens = iterations * running
            cost = cost_of(tokens * per_sequence_ms, 0, tokens, batch_size) if unit is None else unit * tokens
            if cost:
                weighted = cost / weights.get(tenant, 1.0)
                counters[tenant] = counters.get(tenant, 0.0) + weighted
                charged[tenant] = charged.get(tenant, 0.0) + weighted

    def finish(self, request: Request, now_ms: float) -> None:
        tenant = request.tenant
        self._finished[tenant] = self._finished.get(tenant, 0) + 1
        left = self._in_flight[tenant] - 1  # ``QueuedPolicy.finish``, written out: once per request
        self._in_flight[tenant] = left
        if not left and tenant not in self._queues:
            self._on_inactive(tenant, now_ms)

    def _cost(self, gpu_ms: float, input_tokens: int, output_tokens: int, batch_size: int) -> float:
        raise NotImplementedError  # abstract: each counter policy defines its unit of work

    def _decode_unit(self, batch_size: int) -> float | None:
        """What ``_cost`` gives a generated token at ``batch_size`` when it reads nothing else (``_cost(ms, 0,
        tokens, B)`` is then exactly ``unit * tokens``), so ``charge_decode`` need not call it per tenant; None:
        call it."""
        return None


class VTC(CounterPolicy):
    """Virtual Token Counter (Sheng et al., OSDI 2024) with its shipped weights.

    Args:
        input_weight: counter units per prompt token, charged at admission (default 1).
        output_weight: counter units per generated token (default 2).
        weights: tenant -> share weight.
    """

    name = "vtc"

    def __init__(
        self, input_weight: float = 1.0, output_weight: float = 2.0, weights: Mapping[str, float] | None = None
    ) -> None:
        super().__init__(weights)
        if not input_weight >= 0 or not output_weight >= 0:
            raise ValueError("vtc input_weight and output_weight must be >= 0")
        self._input_weight = input_weight
        self._output_weight = output_weight

    def _cost(self, gpu_ms: float, input_tokens: int, output_tokens: int, batch_size: int) -> float:
        return self._input_weight * input_tokens + self._output_weight * output_tokens

    def _decode_unit(self, batch_size: int) -> float | None:
        return self._output_weight  # ``input_weight * 0`` is 0.0 (weights >= 0), and 0.0 + x is x


class VTCCalibrated(CounterPolicy):
    """VTC whose output weight is ``cost.vtc_exchange_rate(B)`` at the batch size of each token.

    Source: seed 002 ("the right constant is a function of the load the scheduler is deciding").
    """

    name = "vtc_calibrated"

    def __init__(self, cost: CostModel, weights: Mapping[str, float] | None = None) -> None:
        super().__init__(weights)
        if cost.prefill_ms_per_token <= 0:
            raise ValueError("vtc_calibrated needs prefill_ms_per_token > 0 (its output weight is a ratio to it)")
        self._cost_model = cost
        self._rate_by_batch: dict[int, float] = {}

    def _cost(self, gpu_ms: float, input_tokens: int, output_tokens: int, batch_size: int) -> float:
        if not output_tokens:
            return float(input_tokens)
        rate = self._rate_by_batch.get(batch_size)
        if rate is None:
            rate = self._rate_by_batch[batch_size] = self._cost_model.vtc_exchange_rate(max(batch_size, 1))
        return input_tokens + rate * output_tokens

    def _decode_unit(self, batch_size: int) -> float | None:
        return self._cost(0.0, 0, 1, batch_size)  # the rate: ``0 + rate * tokens`` is ``rate * tokens``


class GPUFair(CounterPolicy):
    """GPU-time fairness: the counter is the GPU ms charged by the ``dt / B`` rule (seed 002).

    Committed work: a request admitted with a declared ``max_output_tokens`` will occupy its slot for up
    to that many iterations, and charging only as it is spent lets a tenant win many free slots in a row
    before its counter moves (an agent with 8k-token outputs took 35 of 48 slots in half a second, and
    kept them for minutes). So, as weighted fair queuing orders by virtual finish time (Demers, Keshav,
    Shenker, SIGCOMM 1989) and the ledger holds ``max(estimate, billed)``, the pick compares
    ``counter + committed``: ``committed`` is each running request's undelivered declared output, up to
    ``commit_horizon_tokens``, times the decode charge per token at a full batch, shrinking as its tokens
    are generated and dropped when it finishes. The counter itself still grows only by the GPU time
    actually charged; a request without a declared cap commits nothing.

    The horizon bounds what one pick commits. Committing the whole declared output (8k tokens: 7.6 s)
    would make a long request wait until every other tenant had used that much - over a window shorter
    than the request, the long tenant is starved instead (4 % of the GPU in ``fairgate drill ultra_long``);
    committing nothing lets it take every free slot (46-65 %). 96 tokens (about 89 ms at a full batch of
    seed 002's cost model, the cost of a typical chat answer) gave the agent 22 % against a 25 % share there,
    with every tenant within 3 pp of its share.

    Args:
        weights: tenant -> weight.
        cost: the cost model (the per-token decode charge ``decode_ms(max_batch) / max_batch``); without
            it nothing is committed.
        commit_horizon_tokens: declared output tokens a pick commits at most (0: commit nothing).

    Raises:
        ValueError: a weight <= 0 or a negative horizon.
    """

    name = "gpu_fair"

    def __init__(
        self, weights: Mapping[str, float] | None = None, cost: CostModel | None = None, commit_horizon_tokens: int = 96
    ) -> None:
        super().__init__(weights)
        if (
            isinstance(commit_horizon_tokens, bool)
            or not isinstance(commit_horizon_tokens, int)
            or commit_horizon_tokens < 0
        ):
            raise ValueError(f"commit_horizon_tokens must be an integer >= 0, got {commit_horizon_tokens!r}")
        self._horizon = commit_horizon_tokens
        self._per_token_ms = cost.decode_ms(cost.max_batch) / cost.max_batch if cost is not None else 0.0
        self.committed: dict[str, float] = {}  # tenant -> ms of declared, not yet generated decode work
        self._commits: dict[int, int] = {}  # request id -> its declared max_output_tokens

    def _cost(self, gpu_ms: float, input_tokens: int, output_tokens: int, batch_size: int) -> float:
        return gpu_ms

    def _key(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0) + self.committed.get(tenant, 0.0) / self._weights.get(tenant, 1.0)

    def _keys(self) -> list[float]:
        counters, committed, weights = self.counters, self.committed, self._weights
        if not committed:  # nothing declared (a simulation's requests): ``counter + 0.0``, which is the counter
            return [counters.get(t, 0.0) for t in self._queues]
        return [counters.get(t, 0.0) + committed.get(t, 0.0) / weights.get(t, 1.0) for t in self._queues]

    def _commit(self, request: Request) -> None:
        if request.max_output_tokens and self._per_token_ms:
            # ``max_output_tokens`` is the total of its ``sequences``; each commits up to the horizon
            declared = min(request.max_output_tokens, self._horizon * request.sequences)
            self._commits[request.request_id] = declared
            self.committed[request.tenant] = self.committed.get(request.tenant, 0.0) + declared * self._per_token_ms

    def charge(
        self, tenant: str, gpu_ms: float, input_tokens: int, output_tokens: int, batch_size: int, remote: bool = False
    ) -> None:
        # ``CounterPolicy.charge`` with ``_cost`` (the GPU ms) written out: called for every running tenant at
        # every event of a simulation
        if gpu_ms:
            weighted = gpu_ms / self._weights.get(tenant, 1.0)
            self.counters[tenant] = self.counters.get(tenant, 0.0) + weighted
            if not remote:
                self._charged[tenant] = self._charged.get(tenant, 0.0) + weighted
        if output_tokens and not remote and self.committed.get(tenant):
            self.committed[tenant] = max(0.0, self.committed[tenant] - output_tokens * self._per_token_ms)

    def charge_decode(self, batch: Mapping[str, int], iterations: int, per_sequence_ms: float, batch_size: int) -> None:
        # ``charge`` for each tenant, written out: once per scheduling event of a simulation
        counters, charged, committed, weights = self.counters, self._charged, self.committed, self._weights
        per_token_ms = self._per_token_ms
        for tenant, running in batch.items():
            tokens = iterations * running
            gpu_ms = tokens * per_sequence_ms
            if gpu_ms:
                weighted = gpu_ms / weights.get(tenant, 1.0)
                counters[tenant] = counters.get(tenant, 0.0) + weighted
                charged[tenant] = charged.get(tenant, 0.0) + weighted
            if committed and tokens and committed.get(tenant):
                committed[tenant] = max(0.0, committed[tenant] - tokens * per_token_ms)

    def finish(self, request: Request, now_ms: float) -> None:
        declared = self._commits.pop(request.request_id, None) if self._commits else None
        if declared is not None and self.committed.get(request.tenant):
            undelivered = max(0, declared - request.generated_tokens) * self._per_token_ms
            self.committed[request.tenant] = max(0.0, self.committed[request.tenant] - undelivered)
        CounterPolicy.finish(self, request, now_ms)  # not ``super()``: see there
