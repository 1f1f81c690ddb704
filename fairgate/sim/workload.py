"""A workload: the requests a simulation replays, in arrival order.

Plain columns (Python lists, for fast scalar access in the engines): request ``i`` arrives at
``arrival_ns[i]`` for tenant ``tenants[tenant_index[i]]`` with ``prompt_tokens[i]`` to prefill and will
generate ``output_tokens[i]`` tokens (known to the simulator, never to a policy).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fairgate.core.request import Request


@dataclass
class Workload:
    """Requests sorted by arrival time (ties keep index order).

    Attributes:
        tenants: tenant names; ``tenant_index`` points into it.
        arrival_ns: arrival times, integer ns from the start of the run.
        tenant_index: tenant of each request.
        prompt_tokens: prompt tokens of each request (>= 0).
        output_tokens: tokens each request generates (>= 1).
        duration_ns: arrivals lie in ``[0, duration_ns)``; no iteration starts at or after it.
    """

    tenants: list[str]
    arrival_ns: list[int] = field(default_factory=list)
    tenant_index: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    duration_ns: int = 0

    def __len__(self) -> int:
        return len(self.arrival_ns)

    def requests(self) -> list[Request]:
        """The requests as a policy sees them (made once; policies never change a ``Request``)."""
        cached: list[Request] | None = self.__dict__.get("_requests")
        if cached is None or len(cached) != len(self.arrival_ns):
            tenants, tenant_index, prompt = self.tenants, self.tenant_index, self.prompt_tokens
            cached = [Request(i, tenants[tenant_index[i]], prompt[i], t / 1e6) for i, t in enumerate(self.arrival_ns)]
            self.__dict__["_requests"] = cached
        return cached

    def check(self) -> None:
        """Assert the invariants above (programmer errors, not user input).

        Once per workload as long as its columns are the same lists of the same lengths (a grid runs nine
        policies on each, and the check was 2 % of its time); built-in passes (sorted, min, max) rather than
        generators, which took 3-5 %.
        """
        columns = (self.arrival_ns, self.tenant_index, self.prompt_tokens, self.output_tokens)
        key = (*(id(c) for c in columns), *(len(c) for c in columns), self.duration_ns, len(self.tenants))
        if self.__dict__.get("_checked") == key:
            return
        n = len(self.arrival_ns)
        assert len(self.tenant_index) == len(self.prompt_tokens) == len(self.output_tokens) == n
        assert self.arrival_ns == sorted(self.arrival_ns), "arrivals not sorted"
        if n:
            assert min(self.tenant_index) >= 0 and max(self.tenant_index) < len(self.tenants)
            assert min(self.prompt_tokens) >= 0
            assert min(self.output_tokens) >= 1
        assert self.duration_ns > 0
        self.__dict__["_checked"] = key
