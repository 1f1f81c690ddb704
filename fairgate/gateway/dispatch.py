"""The dispatcher: per-tenant queues in front of the upstreams, drained by the same ``Policy`` objects the
simulator drives, on the wall clock.

Per model there is one pool: one policy object and the upstreams serving that model. A request waits in its
tenant's queue (bounded by the tenant's ``max_queued``) until the policy picks it for a free slot; it then
goes to the least-loaded upstream of its model with a free slot (at most ``max_batch`` in flight each).
Calls follow the simulator's order: ``enqueue`` -> ``pick`` when a slot frees -> ``charge`` (the prefill
estimate at once, then metered GPU time as it is spent) -> ``finish``. A held request (a quota policy)
is retried at the policy's ``wake_at``. A request whose client gave up while queued is skipped when picked.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from fairgate.core.cost import CostModel
from fairgate.core.policy import Policy
from fairgate.core.request import Request, RunningView


class QueueFull(Exception):
    """The tenant's queue holds ``limit`` requests already."""

    def __init__(self, tenant: str, limit: int) -> None:
        super().__init__(f"tenant {tenant!r} has {limit} requests queued (max_queued)")
        self.tenant, self.limit = tenant, limit


class NoUpstream(Exception):
    """No upstream serves the requested model."""


@dataclass
class Upstream:
    """An upstream replica as the dispatcher sees it."""

    name: str
    model: str
    url: str
    max_batch: int
    cost: CostModel
    in_flight: int = 0
    healthy: bool = True


@dataclass
class Lease:
    """A slot on ``upstream`` held by ``request`` until ``Dispatcher.release``."""

    request: Request
    upstream: Upstream
    prefill_estimate_ms: float
    released: bool = False


@dataclass
class _Pool:
    policy: Policy
    upstreams: list[Upstream]
    view: RunningView = field(default_factory=RunningView)
    waiters: dict[int, asyncio.Future[Lease]] = field(default_factory=dict)
    queued: Counter[str] = field(default_factory=Counter)
    abandoned: set[int] = field(default_factory=set)
    wake: asyncio.TimerHandle | None = None
    # Charges booked here since the last ``take_local_charges``: tenant -> [GPU ms, prompt, output tokens].
    unshared: dict[str, list[float]] = field(default_factory=dict)


class Dispatcher:
    """Queues and dispatch for every model (see module docstring).

    Args:
        make_policy: builds a fresh policy object for one model's pool.
        upstreams: every upstream; grouped by ``model``.
        clock: ms, monotonic (the policy's ``now_ms``).
        max_queued: tenant -> queue bound (None: unbounded).
        on_charge: told of every charge booked with a policy: (model, tenant, GPU ms).
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
        self._max_queued = max_queued
        self._pools: dict[str, _Pool] = {}
        for upstream in upstreams:
            pool = self._pools.get(upstream.model)
            if pool is None:
                pool = self._pools[upstream.model] = _Pool(make_policy(), [])
            pool.upstreams.append(upstream)

    def models(self) -> list[str]:
        return sorted(self._pools)

    def mark_down(self, upstream: Upstream) -> None:
        """``upstream`` failed to connect: no more requests go to it until ``mark_up``. When it was the last
        one of its model, the requests queued for that model fail with ``NoUpstream`` (their clients get an
        error rather than waiting for a replica that may never return)."""
        if not upstream.healthy:
            return
        upstream.healthy = False
        pool = self._pools[upstream.model]
        if any(u.healthy for u in pool.upstreams):
            return
        for request_id, future in list(pool.waiters.items()):
            if not future.done():
                future.set_exception(NoUpstream(f"no upstream is up for model {upstream.model!r}"))
            del pool.waiters[request_id]
            pool.abandoned.add(request_id)
        pool.queued.clear()

    def mark_up(self, upstream: Upstream) -> None:
        """``upstream`` answers again: it takes requests."""
        if upstream.healthy:
            return
        upstream.healthy = True
        self._dispatch(self._pools[upstream.model])

    def upstreams(self) -> list[Upstream]:
        """Every upstream, with its ``in_flight`` count now."""
        return [u for pool in self._pools.values() for u in pool.upstreams]

    def queued_by_tenant(self) -> dict[str, int]:
        """Requests waiting in queues now, per tenant (all models)."""
        total: Counter[str] = Counter()
        for pool in self._pools.values():
            total.update({t: n for t, n in pool.queued.items() if n > 0})
        return dict(total)

    def running_by_tenant(self) -> dict[str, int]:
        """Requests holding an upstream slot now, per tenant (all models)."""
        total: Counter[str] = Counter()
        for pool in self._pools.values():
            total.update({t: n for t, n in pool.view.by_tenant.items() if n > 0})
        return dict(total)

    def queued(self, tenant: str, model: str) -> int:
        return self._pools[model].queued[tenant] if model in self._pools else 0

    async def acquire(
        self, request: Request, model: str, on_wait: Callable[[], Awaitable[None]] | None = None
    ) -> Lease:
        """Queue ``request`` and wait for a slot.

        ``on_wait`` is awaited once if the request cannot have a slot at once (the gateway takes a place in
        the global queue count there); if it raises, the request leaves the queue and the error propagates
        - unless a slot was granted meanwhile.

        Raises:
            NoUpstream: no upstream serves ``model``. QueueFull: the tenant's queue is full.
            asyncio.CancelledError: the caller gave up (the request is dropped from the queue).
        """
        pool = self._pools.get(model)
        if pool is None or not any(u.healthy for u in pool.upstreams):
            raise NoUpstream(f"no upstream serves model {model!r}")
        limit = self._max_queued(request.tenant)
        if limit is not None and pool.queued[request.tenant] >= limit:
            raise QueueFull(request.tenant, limit)
        future: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()
        pool.waiters[request.request_id] = future
        pool.queued[request.tenant] += 1
        pool.policy.enqueue(request, self._clock())
        self._dispatch(pool)
        try:
            if on_wait is not None and not future.done():
                try:
                    await on_wait()
                except Exception:
                    if not (future.done() and not future.cancelled()):
                        raise
            return await future
        except BaseException:
            if future.done() and not future.cancelled() and future.exception() is None:
                self.release(future.result())  # granted just as the caller gave up
            elif request.request_id in pool.waiters:
                del pool.waiters[request.request_id]
                pool.queued[request.tenant] -= 1
                pool.abandoned.add(request.request_id)
            raise

    def release(self, lease: Lease, generated_tokens: int | None = None) -> None:
        """Free the slot (on every path: success, error, timeout, disconnect); idempotent.

        ``generated_tokens``: output tokens the request produced (the policy's committed-work accounting)."""
        if lease.released:
            return
        if generated_tokens is not None:
            lease.request.generated_tokens = generated_tokens
        lease.released = True
        pool = self._pools[lease.upstream.model]
        lease.upstream.in_flight -= 1
        pool.view.by_tenant[lease.request.tenant] -= 1
        pool.policy.finish(lease.request, self._clock())
        self._dispatch(pool)

    def charge(self, model: str, tenant: str, gpu_ms: float, output_tokens: int, batch_size: int) -> None:
        """Book metered work with the model's policy."""
        pool = self._pools[model]
        pool.policy.charge(tenant, gpu_ms, 0, output_tokens, batch_size)
        self._unshared(pool, tenant, gpu_ms, 0, output_tokens)
        if gpu_ms:
            self._on_charge(model, tenant, gpu_ms)

    @staticmethod
    def _unshared(pool: _Pool, tenant: str, gpu_ms: float, input_tokens: int, output_tokens: int) -> None:
        totals = pool.unshared.setdefault(tenant, [0.0, 0, 0])
        totals[0] += gpu_ms
        totals[1] += input_tokens
        totals[2] += output_tokens

    def take_local_charges(self, model: str) -> dict[str, tuple[float, int, int]]:
        """The charges booked by this process on ``model``'s pool since the last call, per tenant:
        (GPU ms, prompt tokens, output tokens); for sharing with other gateway processes."""
        pool = self._pools[model]
        taken, pool.unshared = pool.unshared, {}
        return {
            tenant: (gpu_ms, int(tokens_in), int(tokens_out))
            for tenant, (gpu_ms, tokens_in, tokens_out) in taken.items()
        }

    def charge_remote(self, model: str, tenant: str, gpu_ms: float, input_tokens: int, output_tokens: int) -> None:
        """Book work another gateway process charged (to the same upstreams' pool), so this process's
        policy counts every tenant's global usage. The batch size of remote work is unknown; the pool's
        largest ``max_batch`` is assumed (it only matters to ``vtc_calibrated``)."""
        pool = self._pools[model]
        batch = max(u.max_batch for u in pool.upstreams)
        pool.policy.charge(tenant, gpu_ms, input_tokens, output_tokens, batch, remote=True)
        self._dispatch(pool)  # a policy that holds requests by budget may release one now

    def _dispatch(self, pool: _Pool) -> None:
        now = self._clock()
        while pool.policy.queued():
            free = [u for u in pool.upstreams if u.healthy and u.in_flight < u.max_batch]
            if not free:
                return
            request = pool.policy.pick(now, pool.view)
            if request is None:
                self._schedule_wake(pool, now)
                return
            future = pool.waiters.pop(request.request_id, None)
            if future is not None and future.done():
                # Its caller was cancelled in this very tick (its client left while it waited) and has not
                # yet taken it out of the queue: it gets no slot (setting a result would raise here, inside
                # someone else's release, and leak that slot).
                pool.queued[request.tenant] -= 1
                future = None
            if future is None or request.request_id in pool.abandoned:
                pool.abandoned.discard(request.request_id)
                pool.policy.finish(request, now)  # its client left while it waited
                continue
            upstream = min(free, key=lambda u: (u.in_flight / u.max_batch, u.in_flight))
            upstream.in_flight += 1
            pool.queued[request.tenant] -= 1
            pool.view.by_tenant[request.tenant] = pool.view.by_tenant.get(request.tenant, 0) + 1
            prefill_ms = upstream.cost.prefill_ms(request.prompt_tokens)
            pool.policy.charge(request.tenant, prefill_ms, request.prompt_tokens, 0, upstream.in_flight)
            self._unshared(pool, request.tenant, prefill_ms, request.prompt_tokens, 0)
            self._on_charge(upstream.model, request.tenant, prefill_ms)
            future.set_result(Lease(request, upstream, prefill_ms))

    def _schedule_wake(self, pool: _Pool, now: float) -> None:
        wake_ms = pool.policy.wake_at(now)
        if wake_ms is None:
            return
        if pool.wake is not None:
            pool.wake.cancel()
        delay_s = max(0.001, (wake_ms - now) / 1000.0)
        pool.wake = asyncio.get_running_loop().call_later(delay_s, self._dispatch, pool)
