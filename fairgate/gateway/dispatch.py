"""The dispatcher: per-tenant queues in front of the upstreams, drained by the same admit step and policy
objects the simulator drives (``fairgate.core.admit``), on the wall clock.

Per pool (``Upstream.pool``: by default the upstream's model) there is one ``Admitter`` (its policy, the
queued and running counts) and the upstreams of that pool. A request names its pools in order (an alias's
primary and approved fallbacks, ``fairgate.gateway.aliases``; a plain model's one pool) and queues in the
first that has an upstream up; if that pool loses its last upstream while the request waits, the request
moves to the next pool with one up (else it fails with ``NoUpstream``). It waits in its tenant's queue
(bounded by the tenant's ``max_queued``) until a slot frees on the least-loaded upstream of the pool (at
most ``max_batch`` in flight each) and the policy picks it; the admit step counts it running and charges
its prefill estimate; metered GPU time is charged as it is spent; the request leaves its slot by
``release`` (``finish``). A held request (a quota policy) is retried at the policy's ``wake_at``. A request
whose caller leaves while it waits is taken out of the policy's queue (``Policy.remove``).

A request of ``n`` sequences (OpenAI's ``n``; intake refuses ``n`` above the smallest ``max_batch`` of its
model) takes ``n`` slots of one upstream at once. Once the policy has picked it, it is *held*: no other
request is picked until ``n`` slots are free on one upstream of its pool, which then all go to it (gang
admission; the slots that free meanwhile stay idle, at most ``n - 1`` of them, until then). Picking another
request past it instead could starve it, and its turn was fairly its tenant's.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from fairgate.core.admit import Admitter
from fairgate.core.cost import CostModel
from fairgate.core.policy import Policy
from fairgate.core.request import Request

log = logging.getLogger("fairgate.gateway")


class QueueFull(Exception):
    """The tenant's queue holds ``limit`` requests already."""

    def __init__(self, tenant: str, limit: int) -> None:
        super().__init__(f"tenant {tenant!r} has {limit} requests queued (max_queued)")
        self.tenant, self.limit = tenant, limit


class NoUpstream(Exception):
    """No upstream serves the requested model, or none of them is up (in any of its pools)."""


@dataclass
class Upstream:
    """An upstream replica as the dispatcher sees it: ``model`` is the engine's model name (sent upstream),
    ``pool`` the fair queue it serves (empty: ``model``)."""

    name: str
    model: str
    url: str
    max_batch: int
    cost: CostModel
    in_flight: int = 0
    healthy: bool = True
    pool: str = ""
    # the engine's own load, where it reports one (``fairgate.gateway.engine_load``): requests in its running
    # batch and queued inside it for a slot; None: not known
    engine_running: float | None = None
    engine_waiting: float | None = None
    engine_running_max: float = 0.0  # the most it was seen running at once: its slots, as far as is known
    engine_queue_reads: int = 0  # consecutive reads that found it full and requests queued in it
    retired: bool = False  # taken out by a reload: no new request; gone once its requests end (``retire``)

    def __post_init__(self) -> None:
        self.pool = self.pool or self.model

    @property
    def overfilled(self) -> bool:
        """Two reads in a row found its engine running as many requests as it was ever seen to and more
        queued inside it: more requests than it has slots (another client shares it, or ``max_batch`` is set
        above its slots) - not a request waiting for the next iteration while a slot is free (an engine
        takes new requests in between iterations, so its queue is seldom empty under load)."""
        return self.engine_queue_reads >= 2

    @property
    def serving(self) -> bool:
        """Up and not retired: it takes requests when it has slots."""
        return self.healthy and not self.retired

    def takes(self, sequences: int = 1) -> bool:
        """Whether ``sequences`` more fit: it is up, has the slots, and its engine is not ``overfilled`` (a
        request queued inside an engine waits first come, first served, outside any fairness)."""
        return self.serving and self.in_flight + sequences <= self.max_batch and not self.overfilled


@dataclass
class Lease:
    """A slot on ``upstream`` held by ``request`` until ``Dispatcher.release``."""

    request: Request
    upstream: Upstream
    prefill_estimate_ms: float
    released: bool = False

    @property
    def slots(self) -> int:
        """Slots it holds: one per sequence."""
        return self.request.sequences


@dataclass
class _Pool:
    admitter: Admitter
    upstreams: list[Upstream]
    waiters: dict[int, asyncio.Future[Lease]] = field(default_factory=dict)
    wake: asyncio.TimerHandle | None = None
    # Charges booked here since the last ``take_local_charges``: tenant -> [GPU ms, prompt, output tokens].
    unshared: dict[str, list[float]] = field(default_factory=dict)
    # A picked request of several sequences waiting for that many free slots on one upstream, and its
    # prefill estimate (see module docstring).
    held: tuple[Request, float] | None = None


class Dispatcher:
    """Queues and dispatch for every pool (see module docstring).

    Args:
        make_policy: builds a fresh policy object for one pool.
        upstreams: every upstream; grouped by ``pool``.
        clock: ms, monotonic (the policy's ``now_ms`` and requests' arrival times).
        max_queued: tenant -> queue bound per pool (None: unbounded).
        on_charge: told of every charge booked with a policy: (pool, tenant, GPU ms).
    """

    def __init__(
        self,
        make_policy: Callable[[], Policy],
        upstreams: list[Upstream],
        clock: Callable[[], float],
        max_queued: Callable[[str], int | None],
        on_charge: Callable[[str, str, float], None] | None = None,
    ) -> None:
        self._clock = clock
        self._on_charge = on_charge or (lambda model, tenant, gpu_ms: None)
        self.on_gone: Callable[[Upstream], None] = lambda upstream: None  # a retired upstream's last request ended
        self._max_queued = max_queued
        self._ids = itertools.count(1)  # the policy's tie-break: arrival order within this process
        self._pools: dict[str, _Pool] = {}
        for upstream in upstreams:
            pool = self._pools.get(upstream.pool)
            if pool is None:
                pool = self._pools[upstream.pool] = _Pool(Admitter(make_policy()), [])
            pool.upstreams.append(upstream)

    def models(self) -> list[str]:
        """The pool names, sorted (a pool is named after its model unless ``[[upstream]].pool`` says else)."""
        return sorted(self._pools)

    def policy(self, pool: str) -> Policy:
        """The policy object of ``pool``. Raises ``KeyError`` for a pool no upstream serves."""
        return self._pools[pool].admitter.policy

    def upstreams(self) -> list[Upstream]:
        """Every upstream, with its ``in_flight`` count now (retired ones included until their requests end)."""
        return [u for pool in self._pools.values() for u in pool.upstreams]

    def add(self, upstream: Upstream) -> None:
        """A new upstream of a running pool (a reload) takes requests at once. Raises ``KeyError`` for a pool
        not running (a new pool's policy and queues are built at start: a restart adds it)."""
        pool = self._pools[upstream.pool]
        pool.upstreams.append(upstream)
        self._dispatch(pool)

    def retire(self, upstream: Upstream) -> None:
        """``upstream`` takes no new request (a reload removed it); its requests run to their end, then it is
        forgotten and ``on_gone`` told (at once when it runs none)."""
        upstream.retired = True
        if upstream.in_flight <= 0:
            self._forget(upstream)
        pool = self._pools[upstream.pool]
        if not any(u.serving for u in pool.upstreams):
            self._fail_waiters(pool)  # as when its last upstream goes down: they move on or fail, not hang
        self._dispatch(pool)  # a held request no upstream left can ever fit fails now

    def revive(self, upstream: Upstream) -> None:
        """A retired upstream still draining is configured again as it was (a reload undone): it takes requests."""
        upstream.retired = False
        self._dispatch(self._pools[upstream.pool])

    def _forget(self, upstream: Upstream) -> None:
        pool = self._pools[upstream.pool]
        if upstream in pool.upstreams:
            pool.upstreams.remove(upstream)
            self.on_gone(upstream)

    def request(self, tenant: str, prompt_tokens: int, max_output_tokens: int, sequences: int = 1) -> Request:
        """A new request as the policy sees it, arriving now: ``sequences`` sequences (slots) that generate
        ``max_output_tokens`` in total at most."""
        return Request(next(self._ids), tenant, prompt_tokens, self._clock(), max_output_tokens, sequences=sequences)

    def mark_down(self, upstream: Upstream) -> None:
        """``upstream`` failed to connect: no more requests go to it until ``mark_up``. When it was the last
        one of its pool, the requests queued there fail with ``NoUpstream`` (``acquire`` moves each to its
        next pool with an upstream up; else the client gets an error rather than waiting for a replica that
        may never return)."""
        if not upstream.healthy:
            return
        upstream.healthy = False
        log.warning("upstream %s is down: it refused a connection", upstream.name)
        pool = self._pools[upstream.pool]
        if any(u.serving for u in pool.upstreams):
            return
        self._fail_waiters(pool)

    def _fail_waiters(self, pool: _Pool) -> None:
        """The pool has no upstream serving: every request queued there fails with ``NoUpstream`` (``acquire``
        moves each to its next pool with an upstream up; else the client gets an error)."""
        now = self._clock()
        name = next((u.pool for u in pool.upstreams), "?")
        for request_id, future in list(pool.waiters.items()):
            if not future.done():
                future.set_exception(NoUpstream(f"no upstream is up for model {name!r}"))
            del pool.waiters[request_id]
            pool.admitter.remove(request_id, now)
        self._drop_held(pool, None)

    def mark_up(self, upstream: Upstream) -> None:
        """``upstream`` answers again: it takes requests."""
        if upstream.healthy:
            return
        upstream.healthy = True
        log.warning("upstream %s is back", upstream.name)
        self._dispatch(self._pools[upstream.pool])

    def engine_load(self, upstream: Upstream, running: float | None, waiting: float | None) -> None:
        """The engine's own load, as it reported it just now (None: unknown); dispatches again when an
        ``overfilled`` engine's queue has drained."""
        was = upstream.overfilled
        upstream.engine_running, upstream.engine_waiting = running, waiting
        upstream.engine_running_max = max(upstream.engine_running_max, running or 0.0)
        full = running is not None and running >= upstream.engine_running_max
        upstream.engine_queue_reads = upstream.engine_queue_reads + 1 if waiting and full else 0
        if was and not upstream.overfilled:
            self._dispatch(self._pools[upstream.pool])

    def queued_by_tenant(self) -> dict[str, int]:
        """Requests waiting in queues now, per tenant (all models)."""
        return _add(pool.admitter.queued_by_tenant() for pool in self._pools.values())

    def running_by_tenant(self) -> dict[str, int]:
        """Requests holding an upstream slot now, per tenant (all models)."""
        return _add(pool.admitter.running_by_tenant() for pool in self._pools.values())

    def queued(self, tenant: str, pool: str) -> int:
        """Requests of ``tenant`` waiting in ``pool`` now (0 for an unknown pool)."""
        return self._pools[pool].admitter.queued(tenant) if pool in self._pools else 0

    async def acquire(
        self, request: Request, pools: str | Sequence[str], on_wait: Callable[[], Awaitable[None]] | None = None
    ) -> Lease:
        """Queue ``request`` in the first of ``pools`` (a name, or names in order: primary, then approved
        fallbacks) that has an upstream up, and wait for a slot; should that pool lose its last upstream
        meanwhile, the request moves on to the next of ``pools`` with one up.

        ``on_wait`` is awaited once if the request cannot have a slot at once (the gateway takes a place in
        the global queue count there); if it raises, the request leaves the queue and the error propagates
        - unless a slot was granted meanwhile.

        Raises:
            NoUpstream: no upstream of ``pools`` is up. QueueFull: the tenant's queue in the pool is full.
            asyncio.CancelledError: the caller gave up (the request leaves the queue).
        """
        names = (pools,) if isinstance(pools, str) else tuple(pools)
        waited = on_wait is None

        async def once() -> None:
            nonlocal waited  # a request moved to a fallback pool keeps the queue place it took
            if not waited:
                waited = True
                assert on_wait is not None
                await on_wait()

        for name in names:
            pool = self._pools.get(name)
            if pool is None or not any(u.serving for u in pool.upstreams):
                continue
            try:
                return await self._wait_in(pool, request, once)
            except NoUpstream:
                continue  # the pool lost its last upstream while the request waited: on to the next one
        raise NoUpstream(f"no upstream is up in pool(s) {', '.join(names)}")

    async def _wait_in(self, pool: _Pool, request: Request, on_wait: Callable[[], Awaitable[None]]) -> Lease:
        """``acquire`` in one pool that has an upstream up."""
        limit = self._max_queued(request.tenant)
        if limit is not None and pool.admitter.queued(request.tenant) >= limit:
            raise QueueFull(request.tenant, limit)
        future: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()
        pool.waiters[request.request_id] = future
        pool.admitter.enqueue(request, self._clock())
        self._dispatch(pool)
        try:
            if not future.done():
                try:
                    await on_wait()
                except Exception:
                    if not (future.done() and not future.cancelled()):
                        raise
            return await future
        except BaseException:
            if future.done() and not future.cancelled() and future.exception() is None:
                self.release(future.result())  # granted just as the caller gave up
            elif pool.waiters.pop(request.request_id, None) is not None:
                if self._drop_held(pool, request):
                    self._dispatch(pool)  # the slots it was waiting for go to the next request
                else:
                    pool.admitter.remove(request.request_id, self._clock())
            raise

    def release(self, lease: Lease, generated_tokens: int | None = None) -> None:
        """Free the slot (on every path: success, error, timeout, disconnect); idempotent.

        ``generated_tokens``: output tokens the request produced (the policy's committed-work accounting)."""
        if lease.released:
            return
        lease.released = True
        pool = self._pools[lease.upstream.pool]
        lease.upstream.in_flight -= lease.slots
        pool.admitter.finish(lease.request, self._clock(), generated_tokens)
        if lease.upstream.retired and lease.upstream.in_flight <= 0:
            self._forget(lease.upstream)
        self._dispatch(pool)

    def charge(self, pool_name: str, tenant: str, gpu_ms: float, output_tokens: int, batch_size: int) -> None:
        """Book metered work with the pool's policy."""
        pool = self._pools[pool_name]
        pool.admitter.charge(tenant, gpu_ms, 0, output_tokens, batch_size)
        _unshared(pool, tenant, gpu_ms, 0, output_tokens)
        if gpu_ms:
            self._on_charge(pool_name, tenant, gpu_ms)

    def correct(self, pool_name: str, moves: Mapping[str, float]) -> None:
        """Move GPU ms booked with the pool's policy between tenants (tenant -> ms, negative: taken back): a
        prompt's cached prefix found at settlement (``fairgate.core.prefix_cache``). Shared with the other
        processes like any charge."""
        pool = self._pools[pool_name]
        for tenant, gpu_ms in moves.items():
            pool.admitter.charge(tenant, gpu_ms, 0, 0, 1)  # no tokens: the batch size is not read
            _unshared(pool, tenant, gpu_ms, 0, 0)
        self._dispatch(pool)

    def take_local_charges(self, pool_name: str) -> dict[str, tuple[float, int, int]]:
        """The charges booked by this process on the pool since the last call, per tenant:
        (GPU ms, prompt tokens, output tokens); for sharing with other gateway processes. A tenant's GPU ms
        taken back beyond what it was charged since (``correct``) waits for its next charges: what is shared
        only ever grows."""
        pool = self._pools[pool_name]
        taken, pool.unshared = pool.unshared, {}
        for tenant, totals in taken.items():
            if totals[0] < 0:
                pool.unshared[tenant] = [totals[0], 0, 0]
        return {
            tenant: (max(0.0, gpu_ms), int(inputs), int(outputs)) for tenant, (gpu_ms, inputs, outputs) in taken.items()
        }

    def charge_remote(self, pool_name: str, tenant: str, gpu_ms: float, input_tokens: int, output_tokens: int) -> None:
        """Book work another gateway process charged (to the same upstreams' pool), so this process's
        policy counts every tenant's global usage. The batch size of remote work is unknown; the pool's
        largest ``max_batch`` is assumed (it only matters to ``vtc_calibrated``)."""
        pool = self._pools[pool_name]
        batch = max(u.max_batch for u in pool.upstreams)
        pool.admitter.charge(tenant, gpu_ms, input_tokens, output_tokens, batch, remote=True)
        self._dispatch(pool)  # a policy that holds requests by budget may release one now

    def _dispatch(self, pool: _Pool) -> None:
        now = self._clock()
        admitter = pool.admitter

        def waiting(request: Request) -> bool:
            # A caller cancelled in this very tick (its client left while it waited) has not yet taken its
            # request out of the queue: it gets no slot (setting a result would raise here, inside someone
            # else's release, and leak that slot).
            future = pool.waiters.get(request.request_id)
            if future is not None and future.done():
                del pool.waiters[request.request_id]
                return False
            return future is not None

        while True:
            if pool.held is None:
                free = [u for u in pool.upstreams if u.takes()]
                if not admitter.queued() or not free:
                    return
                upstream = min(free, key=_load)
                picked = admitter.admit(now, upstream.in_flight + 1, upstream.cost, waiting)
                if picked is None:
                    self._schedule_wake(pool, now)
                    return
                request, prefill_ms = pool.held = picked
                _unshared(pool, request.tenant, prefill_ms, request.prompt_tokens, 0)
                self._on_charge(upstream.pool, request.tenant, prefill_ms)
            request, prefill_ms = pool.held
            if not waiting(request):  # its caller left while it was held
                self._drop_held(pool, request)
                continue
            fitting = [u for u in pool.upstreams if u.takes(request.sequences)]
            if not fitting and not any(not u.retired and u.max_batch >= request.sequences for u in pool.upstreams):
                # No upstream left could ever hold it (a reload took out the larger ones): it fails rather
                # than hold every request behind it.
                name = next((u.pool for u in pool.upstreams), "?")
                pool.waiters.pop(request.request_id).set_exception(
                    NoUpstream(f"no upstream of model {name!r} takes {request.sequences} sequences")
                )
                self._drop_held(pool, request)
                continue
            if not fitting:
                return  # held until enough of its model's slots free (``release`` dispatches again)
            upstream = min(fitting, key=_load)
            pool.held = None
            upstream.in_flight += request.sequences
            pool.waiters.pop(request.request_id).set_result(Lease(request, upstream, prefill_ms))

    def _drop_held(self, pool: _Pool, request: Request | None) -> bool:
        """Forget the held request (``request``, or whichever when None), counted running by the pick: it
        finishes unrun (its prefill estimate stays charged: the policy picked it). Whether one was dropped."""
        if pool.held is None or (request is not None and pool.held[0] is not request):
            return False
        dropped, pool.held = pool.held[0], None
        pool.admitter.finish(dropped, self._clock(), 0)
        return True

    def _schedule_wake(self, pool: _Pool, now: float) -> None:
        wake_ms = pool.admitter.wake_at(now)
        if wake_ms is None:
            return
        if pool.wake is not None:
            pool.wake.cancel()
        delay_s = max(0.001, (wake_ms - now) / 1000.0)
        pool.wake = asyncio.get_running_loop().call_later(delay_s, self._dispatch, pool)


def _load(upstream: Upstream) -> tuple[float, int]:
    """The least-loaded upstream first: by the share of its slots in use, then by its count."""
    return (upstream.in_flight / upstream.max_batch, upstream.in_flight)


def _unshared(pool: _Pool, tenant: str, gpu_ms: float, input_tokens: int, output_tokens: int) -> None:
    totals = pool.unshared.setdefault(tenant, [0.0, 0, 0])
    totals[0] += gpu_ms
    totals[1] += input_tokens
    totals[2] += output_tokens


def _add(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for part in counts:
        for tenant, n in part.items():
            total[tenant] = total.get(tenant, 0) + n
    return total
