"""The ``Policy`` protocol: one object decides who runs next, for the simulator and the gateway alike.

Both drivers call the same methods in the same order (``shared/DESIGN.md``, "One policy object, two
drivers"), through one admit step (``fairgate.core.admit.Admitter``): ``enqueue`` when a request is
handed over, ``pick`` whenever a slot is free (repeatedly, until it returns ``None`` or the slots are
full), ``charge`` as work is spent (the prefill right after a request is picked, decode as iterations
complete), ``finish`` when a request leaves its slot, ``remove`` when a queued request leaves unpicked.

Contract every policy keeps, on which the event-compressed engine relies:
- ``pick`` returning ``None`` changes no state, and keeps returning ``None`` until the next ``enqueue``,
  ``finish``, or until ``now_ms >= wake_at(now_ms)``; ``wake_at`` never overshoots the true time a held
  request becomes eligible when nothing else happens.
- ``pick`` returns ``None`` only for requests that are held (a quota, a cap); with a non-empty queue a
  work-conserving policy always returns a request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from typing import Protocol, runtime_checkable

from fairgate.core.request import Request, RunningView


@runtime_checkable
class Policy(Protocol):
    """What the drivers need from a scheduling policy (see the module docstring for the contract)."""

    name: str

    def enqueue(self, request: Request, now_ms: float) -> None:
        """Queue ``request`` (its tenant's queue); ``now_ms`` is the hand-over time."""

    def enqueue_all(self, requests: Iterable[Request], now_ms: float) -> None:
        """``enqueue`` each of ``requests`` in order, all handed over at ``now_ms`` (the simulator delivers every
        arrival since its last scheduling point at once)."""

    def pick(self, now_ms: float, running: RunningView) -> Request | None:
        """The request to admit into a free slot now, removed from its queue; ``None``: hold the slot."""

    def charge(
        self, tenant: str, gpu_ms: float, input_tokens: int, output_tokens: int, batch_size: int, remote: bool = False
    ) -> None:
        """Book work spent by ``tenant``: GPU ms, prompt tokens prefilled, output tokens generated.

        ``batch_size`` is the number of running sequences the work was done at. ``remote``: the work was
        done by requests another gateway process dispatched (counters shared through the ledger): it counts
        in the tenant's usage, not against requests of this policy's. A negative ``gpu_ms`` (no tokens)
        takes back GPU time booked too high: a prompt's prefix the engine had cached, learnt at settlement
        and booked to the tenants that ran beside it instead (``fairgate.core.prefix_cache``).
        """

    def charge_decode(self, batch: Mapping[str, int], iterations: int, per_sequence_ms: float, batch_size: int) -> None:
        """Book ``iterations`` decode iterations of one replica's batch of ``batch_size`` sequences, ``batch[t]``
        of them tenant ``t``'s, each charged ``per_sequence_ms`` (ms) an iteration: for each ``t``, what
        ``charge(t, tokens * per_sequence_ms, 0, tokens, batch_size)`` with ``tokens = iterations * batch[t]`` books
        (the simulator books the iterations between two scheduling events so, in one call)."""

    def finish(self, request: Request, now_ms: float) -> None:
        """``request`` left its slot (finished, cancelled or failed)."""

    def remove(self, request_id: int, now_ms: float) -> Request | None:
        """Take a queued request out before it is picked (its client left, its upstreams went down);
        returns it, or ``None`` if it is not queued (picked already, or never enqueued)."""

    def wake_at(self, now_ms: float) -> float | None:
        """When a held request may become eligible (ms), or ``None`` if nothing is held by time."""

    def queued(self, tenant: str | None = None) -> int:
        """Requests waiting in this policy's queues: ``tenant``'s, or every tenant's (None)."""

    def queued_by_tenant(self) -> dict[str, int]:
        """Requests waiting per tenant (tenants with none left out)."""


class QueuedPolicy:
    """Base for policies with one FIFO queue per tenant; subclasses choose the tenant to serve.

    Subclasses implement ``_select(now_ms, running) -> tenant | None`` and may override the hooks
    ``_on_backlogged`` (a tenant's queue became non-empty), ``_on_idle`` (it became empty), ``_on_pick``
    and ``_on_inactive`` (nothing queued and nothing running). The base counts requests in flight per
    tenant from ``pick`` and ``finish``.
    """

    name = "queued"

    def __init__(self) -> None:
        # Only tenants with a non-empty queue are keys here, in the order they became backlogged.
        self._queues: dict[str, deque[Request]] = {}
        self._queued = 0
        self._in_flight: dict[str, int] = {}  # picked and not yet finished, per tenant

    # --- protocol ------------------------------------------------------------------------------
    def enqueue(self, request: Request, now_ms: float) -> None:
        queue = self._queues.get(request.tenant)
        if queue is None:
            self._on_backlogged(request.tenant, now_ms)
            queue = self._queues[request.tenant] = deque()
        queue.append(request)
        self._queued += 1

    def enqueue_all(self, requests: Iterable[Request], now_ms: float) -> None:
        # ``enqueue`` for each, in one call: a simulation hands over thousands of arrivals per run, most of them
        # to a queue that exists already. The count is brought up to date before each hook, as ``enqueue`` has it.
        queues, added = self._queues, 0
        for request in requests:
            queue = queues.get(request.tenant)
            if queue is None:
                self._queued += added
                added = 0
                self._on_backlogged(request.tenant, now_ms)
                queue = queues[request.tenant] = deque()
            queue.append(request)
            added += 1
        self._queued += added

    def pick(self, now_ms: float, running: RunningView) -> Request | None:
        if not self._queued:
            return None
        tenant = self._select(now_ms, running)
        if tenant is None:
            return None
        queue = self._queues[tenant]
        request = queue.popleft()
        self._queued -= 1
        if not queue:
            del self._queues[tenant]
            self._on_idle(tenant, now_ms)
        self._in_flight[tenant] = self._in_flight.get(tenant, 0) + 1
        self._on_pick(request, now_ms)
        return request

    def charge(
        self, tenant: str, gpu_ms: float, input_tokens: int, output_tokens: int, batch_size: int, remote: bool = False
    ) -> None:
        return None

    def charge_decode(self, batch: Mapping[str, int], iterations: int, per_sequence_ms: float, batch_size: int) -> None:
        charge = self.charge
        for tenant, running in batch.items():
            tokens = iterations * running
            charge(tenant, tokens * per_sequence_ms, 0, tokens, batch_size)

    def finish(self, request: Request, now_ms: float) -> None:
        left = self._in_flight[request.tenant] - 1
        self._in_flight[request.tenant] = left
        if not left and request.tenant not in self._queues:
            self._on_inactive(request.tenant, now_ms)

    def remove(self, request_id: int, now_ms: float) -> Request | None:
        # A linear scan: removals are rare (a client that left its queue) and queues are bounded by
        # ``max_queued``; an index by id would cost every enqueue and pick of the simulator's hot path.
        for tenant, queue in self._queues.items():
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self._queued -= 1
                    if not queue:
                        del self._queues[tenant]
                        self._on_idle(tenant, now_ms)
                        if not self._running(tenant):
                            self._on_inactive(tenant, now_ms)
                    return request
        return None

    def wake_at(self, now_ms: float) -> float | None:
        return None

    def queued(self, tenant: str | None = None) -> int:
        if tenant is None:
            return self._queued
        queue = self._queues.get(tenant)
        return len(queue) if queue is not None else 0

    def queued_by_tenant(self) -> dict[str, int]:
        return {tenant: len(queue) for tenant, queue in self._queues.items()}

    # --- for subclasses -------------------------------------------------------------------------
    def _select(self, now_ms: float, running: RunningView) -> str | None:
        raise NotImplementedError  # abstract: every concrete policy defines its choice

    def _on_backlogged(self, tenant: str, now_ms: float) -> None:
        return None

    def _on_idle(self, tenant: str, now_ms: float) -> None:
        """The tenant's queue emptied (it may still have requests running)."""
        return None

    def _on_inactive(self, tenant: str, now_ms: float) -> None:
        """The tenant has nothing queued and nothing running any more."""
        return None

    def _running(self, tenant: str) -> int:
        """Requests of ``tenant`` picked and not yet finished."""
        return self._in_flight.get(tenant, 0)

    def _on_pick(self, request: Request, now_ms: float) -> None:
        return None

    def _earliest(self, tenants: Iterable[str] | None = None) -> str | None:
        """The tenant whose head request arrived first (ties: lower request id), among ``tenants``
        (an iterable of backlogged tenants; default all backlogged)."""
        best: str | None = None
        best_key: tuple[float, int] | None = None
        for tenant in self._queues if tenants is None else tenants:
            head = self._queues[tenant][0]
            key = (head.arrival_ms, head.request_id)
            if best_key is None or key < best_key:
                best, best_key = tenant, key
        return best
