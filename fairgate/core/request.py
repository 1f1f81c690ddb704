"""Plain data passed between the drivers (simulator, gateway) and the policies."""

from __future__ import annotations

from dataclasses import dataclass, field

# The most tokens one request may have, prompt or output: keeps every run finite and every count exact
# in the simulator's integer-nanosecond arithmetic (scenarios, traces and the gateway's config use it).
MAX_TOKENS_PER_REQUEST = 10_000_000

# Priority pools, highest first (seed 003, "Fair queuing cannot rely solely on FIFO").
PRIORITIES: tuple[str, ...] = ("interactive", "batch", "eval")


@dataclass(slots=True)
class Request:
    """One inference request as a policy sees it. The output length is *not* known here.

    Attributes:
        request_id: unique, increasing in arrival order within one driver (ties broken by it).
        tenant: the tenant the request is billed to.
        prompt_tokens: input tokens to prefill.
        arrival_ms: arrival time on the driver's clock, ms.
        max_output_tokens: the client's cap, if any (``gpu_fair`` counts it as committed work while the
            request runs).
        generated_tokens: output tokens generated; the driver sets it before ``Policy.finish``.
        sequences: the sequences it runs (OpenAI's ``n``): it takes that many slots, and
            ``max_output_tokens`` is their total.
    """

    request_id: int
    tenant: str
    prompt_tokens: int
    arrival_ms: float
    max_output_tokens: int | None = None
    generated_tokens: int = 0
    sequences: int = 1


@dataclass(slots=True)
class RunningView:
    """What is running now, across every replica behind the policy.

    Attributes:
        by_tenant: tenant -> running sequences (absent means 0).
    """

    by_tenant: dict[str, int] = field(default_factory=dict)

    def running(self, tenant: str) -> int:
        """Running sequences of ``tenant`` now."""
        return self.by_tenant.get(tenant, 0)
