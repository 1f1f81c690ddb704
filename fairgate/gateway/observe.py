"""What happens to each request, as plain events for the gateway's observers (metrics, logs, dashboard).

The request path (``fairgate.gateway.app``) emits one ``Rejected`` or ``Admitted`` per request, then, for an
admitted one, ``Dispatched`` when the policy gives it a slot, ``Finished`` when its upstream call ends and
``Settled`` once its final settlement is booked (or ``Rejected`` with ``after_admission`` when it leaves the
queue without a slot). ``Charged`` carries the
live meter's GPU-time charges as they are booked with the policy (many per request: one per token).
Observers must be quick and must not raise; they run on the event loop.

Times: ``time_s`` is wall-clock seconds since the epoch; durations carry their unit in their name.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

# Why a request was turned away (the ``reason`` label of rejections; seed 003's quota vector).
REJECT_REASONS = (
    "rate",
    "tokens",
    "concurrency",
    "queue_full",
    "gpu_budget",
    "spend_budget",
    "agent_run",
    "ledger_down",
    "no_upstream",
    "auth",
    "invalid",
    "conflict",
    "upstream_error",
)

_BY_DIMENSION = {
    "requests_per_minute": "rate",
    "input_tokens_per_minute": "tokens",
    "output_tokens_per_minute": "tokens",
    "max_tokens_per_request": "tokens",
    "max_concurrent": "concurrency",
    "gpu_seconds": "gpu_budget",
    "gpu_seconds_total": "gpu_budget",
    "spend_budget": "spend_budget",
    "max_model_calls": "agent_run",
    "max_tool_rounds": "agent_run",
    "max_tokens": "agent_run",
}


def reason_for_dimension(dimension: str) -> str:
    """The rejection reason for a ledger quota dimension (``QuotaExceeded.dimension``); unknown -> ``rate``."""
    return _BY_DIMENSION.get(dimension, "rate")


@dataclass(frozen=True)
class Rejected:
    """A request answered with an error before (or instead of) running.

    ``tenant`` is None when the credential was missing or bad (nobody to attribute it to); for a refused
    delegation it is the caller whose key made the request. ``dimension`` is the ledger's quota dimension
    for quota rejections.
    """

    request_id: str
    tenant: str | None
    model: str | None
    reason: str
    status: int
    message: str
    time_s: float
    dimension: str | None = None
    after_admission: bool = False
    retry_after_s: float | None = None  # the wait suggested (before jitter); None: waiting will not help
    code: str | None = None  # the OpenAI-style error code answered
    delegate: str | None = None  # the delegate service acting for ``tenant``, if any
    key_id: str | None = None  # the key it came with (its stored hash's prefix), when it was authenticated


@dataclass(frozen=True)
class Admitted:
    """A reservation was made; the request joins its tenant's queue."""

    request_id: str
    tenant: str
    delegate: str | None
    model: str
    reservation_id: str
    input_tokens: int  # the gateway's estimate of the prompt
    max_output_tokens: int
    gpu_ms_estimate: float
    time_s: float
    key_id: str | None = None  # the key it came with (``identity.Caller.key_id``)


@dataclass(frozen=True)
class Dispatched:
    """The policy gave the request a slot on ``upstream`` after ``queue_ms`` in its tenant's queue."""

    request_id: str
    tenant: str
    model: str
    upstream: str
    queue_ms: float
    time_s: float


@dataclass(frozen=True)
class Finished:
    """The upstream call ended: ``outcome`` is ``completed``, ``cancelled`` (client gone) or ``error``.

    Tokens and ``gpu_ms`` are what was billed; ``gpu_ms_estimate`` and ``max_output_tokens`` what was
    reserved (their difference is the reservation-vs-settlement gap). ``ttft_ms`` is from dispatch to the
    first token (None: no token); ``tpot_ms`` the mean time per output token after the first;
    ``spend_micros`` what the billed usage cost, micros of the pricing currency.
    """

    request_id: str
    tenant: str
    model: str
    upstream: str
    outcome: str
    queue_ms: float
    ttft_ms: float | None
    tpot_ms: float | None
    input_tokens: int
    output_tokens: int
    gpu_ms: float
    gpu_ms_estimate: float
    max_output_tokens: int
    time_s: float
    spend_micros: float = 0.0  # what the billed usage cost at the reservation's price (``ledger.model.Price``)
    cached_tokens: int = 0  # of the prompt, read from the engine's prefix cache
    cache_credit_gpu_ms: float = 0.0  # taken off ``gpu_ms`` for them (``fairgate.core.prefix_cache``)


@dataclass(frozen=True)
class Charged:
    """GPU time booked to ``tenant`` on a pool by the live meter (``dt / B`` shares, seed 002). ``model`` is the
    pool's name (``[[upstream]].pool``, which is the upstreams' model unless the config says otherwise): the
    meter charges a pool's upstreams, not an alias (``fairgate.gateway.aliases``)."""

    tenant: str
    model: str
    gpu_ms: float
    time_s: float


@dataclass(frozen=True)
class Left:
    """The client left while its request was queued, after ``queue_ms``: it never ran, its reservation was
    released and nothing was billed (its terminal event, as ``Finished`` is of a request that ran)."""

    request_id: str
    tenant: str
    model: str
    queue_ms: float
    time_s: float


@dataclass(frozen=True)
class Settled:
    """The final settlement of a request's upstream call was booked (or failed, and is journalled):
    nothing more happens to the request. Emitted after its ``Finished``."""

    request_id: str
    time_s: float


@dataclass(frozen=True)
class Refunded:
    """A call the platform failed (the upstream refused it, died, stalled or sent no OpenAI stream) before the
    client received anything: its reservation was cancelled billing nothing, so the tenant's quota got back
    what the call used. ``input_tokens``, ``output_tokens`` and ``gpu_ms`` are what it used and was not billed
    (the fair policy keeps the GPU time: the replica did spend it); ``problem`` is ``UpstreamError.problem``.
    Emitted before its ``Finished`` (outcome ``error``, billed 0)."""

    request_id: str
    tenant: str
    upstream: str
    problem: str
    input_tokens: int
    output_tokens: int
    gpu_ms: float
    time_s: float


Event = Rejected | Admitted | Dispatched | Finished | Left | Settled | Charged | Refunded


class Observer(Protocol):
    """Receives every event; must not block or raise."""

    def observe(self, event: Event) -> None: ...


class Fanout:
    """Delivers each event to every observer; one failing observer does not stop the others."""

    def __init__(self, observers: Iterable[Observer] = ()) -> None:
        self.observers: list[Observer] = list(observers)

    def add(self, observer: Observer) -> None:
        self.observers.append(observer)

    def observe(self, event: Event) -> None:
        for observer in self.observers:
            try:
                observer.observe(event)
            except Exception:
                import logging

                logging.getLogger("fairgate.gateway").exception("observer %r failed", observer)
