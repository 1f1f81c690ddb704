"""Priority pools: interactive before batch before eval, each pool with its own fair policy.

Source: seed 003 ("Interactive, batch, and evaluation tasks should be divided into priority pools;
batch tasks can utilize idle capacity, but yield resources when interactive traffic resumes";
"prioritize scheduling at the queuing stage" rather than preempting). A lower pool is asked only when
every higher pool is empty or holds its requests; nothing running is preempted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from fairgate.core.policy import Policy
from fairgate.core.request import PRIORITIES, Request, RunningView


class PriorityPools:
    """Routes each tenant to its pool's policy; picks from the highest pool that yields a request.

    Args:
        priority_of: tenant -> pool name (one of ``PRIORITIES``).
        make_pool: builds the policy for one pool (called once per pool in use).

    Raises:
        ValueError: a tenant names an unknown pool.
    """

    def __init__(self, priority_of: Mapping[str, str], make_pool: Callable[[], Policy]) -> None:
        for tenant, priority in priority_of.items():
            if priority not in PRIORITIES:
                raise ValueError(f"tenant {tenant!r}: priority must be one of {PRIORITIES}, got {priority!r}")
        self._priority_of = dict(priority_of)
        used = [p for p in PRIORITIES if p in set(priority_of.values())] or [PRIORITIES[0]]
        self._pools: dict[str, Policy] = {p: make_pool() for p in used}
        self._ordered = [self._pools[p] for p in used]
        self.name = self._ordered[0].name

    @property
    def pools(self) -> tuple[Policy, ...]:
        """Each pool's policy, highest priority first."""
        return tuple(self._ordered)

    def priority_of(self, tenant: str) -> str:
        """The pool ``tenant`` is routed to (a tenant not given at construction or to ``assign``: the first)."""
        wanted = self._priority_of.get(tenant, PRIORITIES[0])
        return wanted if wanted in self._pools else next(iter(self._pools))

    def assign(self, priority_of: Mapping[str, str]) -> None:
        """Route the tenants of ``priority_of`` not known yet to their pools (a configuration reload adding
        tenants). Raises ``ValueError``: a known tenant's pool changes, or a new tenant names a pool not in
        use (queued and running requests are counted in the pool they entered: a move waits for a restart)."""
        for tenant, priority in priority_of.items():
            known = tenant in self._priority_of
            if (known and priority != self._priority_of[tenant]) or (not known and priority not in self._pools):
                raise ValueError(f"tenant {tenant!r}: priority {priority!r} is applied by a restart only")
        self._priority_of.update({t: p for t, p in priority_of.items() if t not in self._priority_of})

    def _pool(self, tenant: str) -> Policy:
        return self._pools.get(self._priority_of.get(tenant, PRIORITIES[0]), self._ordered[0])

    def enqueue(self, request: Request, now_ms: float) -> None:
        self._pool(request.tenant).enqueue(request, now_ms)

    def enqueue_all(self, requests: Iterable[Request], now_ms: float) -> None:
        for request in requests:
            self._pool(request.tenant).enqueue(request, now_ms)

    def pick(self, now_ms: float, running: RunningView) -> Request | None:
        for pool in self._ordered:
            if pool.queued():
                request = pool.pick(now_ms, running)
                if request is not None:
                    return request
        return None

    def charge(
        self, tenant: str, gpu_ms: float, input_tokens: int, output_tokens: int, batch_size: int, remote: bool = False
    ) -> None:
        self._pool(tenant).charge(tenant, gpu_ms, input_tokens, output_tokens, batch_size, remote)

    def charge_decode(self, batch: Mapping[str, int], iterations: int, per_sequence_ms: float, batch_size: int) -> None:
        for tenant, running in batch.items():
            tokens = iterations * running
            self._pool(tenant).charge(tenant, tokens * per_sequence_ms, 0, tokens, batch_size)

    def finish(self, request: Request, now_ms: float) -> None:
        self._pool(request.tenant).finish(request, now_ms)

    def remove(self, request_id: int, now_ms: float) -> Request | None:
        for pool in self._ordered:
            removed = pool.remove(request_id, now_ms)
            if removed is not None:
                return removed
        return None

    def wake_at(self, now_ms: float) -> float | None:
        times = [t for t in (pool.wake_at(now_ms) for pool in self._ordered) if t is not None]
        return min(times) if times else None

    def queued(self, tenant: str | None = None) -> int:
        if tenant is not None:
            return self._pool(tenant).queued(tenant)
        return sum(pool.queued() for pool in self._ordered)

    def queued_by_tenant(self) -> dict[str, int]:
        return {tenant: n for pool in self._ordered for tenant, n in pool.queued_by_tenant().items()}
