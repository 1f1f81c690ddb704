"""The async ``Ledger`` interface every backend implements, and what they share."""

from __future__ import annotations

import hashlib
import uuid
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fairgate.ledger.config import Limits, Quotas
from fairgate.ledger.model import InvalidUsage, Reservation, TenantUsage, UnknownTenant, Usage, check_name
from fairgate.ledger.rules import Account, check_amounts

# An execution registry: is the request behind this reservation still running?
IsRunning = Callable[[Reservation], Awaitable[bool]]
# Charges booked with a fair policy: (GPU ms, prompt tokens, output tokens).
ChargeTotals = tuple[float, int, int]


@dataclass(frozen=True)
class Event:
    """One row of the usage event log: what a call billed (deltas of the cumulative billed usage)."""

    seq: int
    tenant: str
    reservation_id: str
    kind: str  # reserve | settle | settle_final | cancel | expire
    requests: int
    input_tokens: int
    output_tokens: int
    gpu_ms: float
    overage_gpu_ms: float
    at_ms: float


def tenant_tag(tenant: str) -> str:
    """A stable 16-hex-digit hash of the tenant (used in ids, Redis hash slots and metric labels)."""
    return hashlib.sha256(tenant.encode()).hexdigest()[:16]


def new_reservation_id(tenant: str) -> str:
    """``<tenant tag>-<random 32 hex>``: the tag lets a sharded backend find the tenant from the id."""
    return f"{tenant_tag(tenant)}-{uuid.uuid4().hex}"


def check_request_id(request_id: object) -> str:
    checked = check_name(request_id, "request_id")
    assert checked is not None
    return checked


def check_reserve_args(
    tenant: object, request_id: object, model_class: object, run_id: object, tool_round: object
) -> None:
    """Validate ``reserve``'s names and flags. Raises ``InvalidUsage``."""
    check_name(tenant, "tenant")
    check_name(request_id, "request_id")
    check_name(model_class, "model_class")
    check_name(run_id, "run_id", optional=True)
    if not isinstance(tool_round, bool):
        raise InvalidUsage(f"tool_round must be true or false, got {tool_round!r:.80}")


STATUSES = ("open", "settled", "cancelled", "expired")


def check_consumed(consumed: object) -> Usage:
    """``cancel``'s ``consumed``: a ``Usage`` of valid amounts, with ``gpu_ms`` as a float. Raises ``InvalidUsage``."""
    if not isinstance(consumed, Usage):
        raise InvalidUsage(f"cancel: consumed must be a Usage, got {consumed!r:.80}")
    check_amounts(consumed.input_tokens, consumed.output_tokens, consumed.gpu_ms, "cancel")
    return Usage(consumed.input_tokens, consumed.output_tokens, float(consumed.gpu_ms))


def check_window(window_s: object) -> float:
    if isinstance(window_s, bool) or not isinstance(window_s, int | float) or not 0 < window_s <= 10 * 365 * 86_400:
        raise InvalidUsage(f"usage: window_s must be a number of seconds in (0, 10 years], got {window_s!r:.80}")
    return float(window_s)


class Ledger(ABC):
    """Reserve / settle / cancel with idempotency, on one backend (``connect`` picks it by URL).

    All amounts are cumulative where they describe usage: ``settle(..., input_tokens=100,
    output_tokens=40, ...)`` means 100 and 40 *so far*, so a repeated call changes nothing.
    """

    def __init__(self, quotas: Quotas) -> None:
        self.quotas = quotas

    def limits(self, tenant: str, model_class: str) -> Limits:
        """The tenant's limits for ``model_class``. Raises ``UnknownTenant``."""
        try:
            return self.quotas.tenant(tenant).for_model_class(model_class)
        except KeyError:
            raise UnknownTenant(f"tenant {tenant!r} has no quota configuration") from None

    @abstractmethod
    async def reserve(
        self,
        tenant: str,
        request_id: str,
        input_tokens: int,
        max_output_tokens: int,
        gpu_ms_estimate: float = 0.0,
        model_class: str = "default",
        run_id: str | None = None,
        tool_round: bool = False,
    ) -> Reservation:
        """Reserve every dimension for one request, atomically, once per ``(tenant, request_id)``.

        The same ``request_id`` with the same arguments returns the original reservation (whatever its
        status now) and deducts nothing; with other arguments raises ``IdempotencyConflict``.

        Raises:
            QuotaExceeded, IdempotencyConflict, InvalidUsage, UnknownTenant, LedgerUnavailable.
        """

    @abstractmethod
    async def settle(
        self, reservation_id: str, input_tokens: int, output_tokens: int, gpu_ms: float, final: bool = False
    ) -> Reservation:
        """Bill cumulative usage; ``final`` closes the reservation and releases the unused remainder.

        A final settle repeated with the same amounts returns the same reservation.

        Raises:
            ReservationNotFound, ReservationFinal, InvalidUsage, SettlementFrozen, LedgerUnavailable.
        """

    @abstractmethod
    async def cancel(self, reservation_id: str, consumed: Usage) -> Reservation:
        """Close the reservation billing ``consumed`` (prompt and tokens generated so far), releasing the rest.

        Raises:
            ReservationNotFound, ReservationFinal, InvalidUsage, SettlementFrozen, LedgerUnavailable.
        """

    @abstractmethod
    async def enqueue(self, reservation_id: str) -> Reservation:
        """The request behind ``reservation_id`` waits for an upstream slot: take a place in its tenant's
        queue (``max_queued``, global). Idempotent; a no-op on a final reservation.

        Raises:
            QuotaExceeded (``max_queued``), ReservationNotFound, LedgerUnavailable.
        """

    @abstractmethod
    async def dequeue(self, reservation_id: str) -> Reservation:
        """The queued request got an upstream slot: give its queue place back. Idempotent; a no-op when it
        holds none (the final settlement gives a place back too). Raises ``ReservationNotFound``,
        ``LedgerUnavailable``."""

    @abstractmethod
    async def account(self, tenant: str, model_class: str = "default") -> Account:
        """The balances held for ``tenant`` and ``model_class`` now (as last written; buckets not refilled)."""

    @abstractmethod
    async def get(self, reservation_id: str) -> Reservation:
        """The reservation. Raises ``ReservationNotFound``."""

    @abstractmethod
    async def usage(self, tenant: str, window_s: float) -> TenantUsage:
        """The tenant's billed usage over the last ``window_s`` seconds, and its open reservations."""

    @abstractmethod
    async def reservations(self, tenant: str | None = None, status: str | None = None) -> list[Reservation]:
        """Reservations, optionally of one tenant and/or status."""

    @abstractmethod
    async def events(self, tenant: str | None = None) -> list[Event]:
        """The usage event log in order, optionally of one tenant."""

    @abstractmethod
    async def heartbeat(self, reservation_id: str) -> None:
        """Record that the request behind ``reservation_id`` is running now (the default registry)."""

    @abstractmethod
    async def expire_due(self, is_running: IsRunning | None = None) -> list[Reservation]:
        """One sweeper pass: for each open reservation past its TTL, ask ``is_running``, and extend the
        running ones by a TTL from now; by default (no ``is_running``) a reservation heartbeat within the
        TTL runs, and is extended to a TTL after that heartbeat - so a dead process's reservation is
        expired by the first sweep a TTL after its last heartbeat. Expire the others (billing what was
        settled so far). Returns the reservations expired."""

    @abstractmethod
    async def freeze(self, tenant: str, reason: str) -> None:
        """Stop automatic settlement for ``tenant`` (reconciliation found a difference)."""

    @abstractmethod
    async def unfreeze(self, tenant: str) -> None:
        """Resume automatic settlement for ``tenant``."""

    @abstractmethod
    async def frozen(self) -> dict[str, str]:
        """Frozen tenants and why."""

    @abstractmethod
    async def add_charges(self, scope: str, deltas: dict[str, ChargeTotals]) -> dict[str, ChargeTotals]:
        """Add ``deltas`` (tenant -> (GPU ms, prompt tokens, output tokens) charged by this process's policy
        since its last call) to the shared totals of ``scope`` (a model's pool), atomically; return every
        tenant's totals in that scope after the addition. This is how gateway processes sharing a ledger
        share the counters their fair policies read (issue 6). Raises ``LedgerUnavailable``."""

    @abstractmethod
    async def share_occupancy(
        self, process: str, occupancy: dict[str, tuple[float, float]], stale_after_ms: float
    ) -> dict[str, tuple[float, float]]:
        """Publish gateway process ``process``'s occupancy of its upstreams - upstream (its URL) -> (sequences
        in the iteration, share of the upstream's time spent prefilling them), averaged over its last round - replacing what it
        published before, and counted for ``stale_after_ms`` (ledger clock) unless published again; return,
        per upstream, the sum over every *other* process's publication still counted. How the live meters of processes sharing a replica split its busy
        time between them (``fairgate.core.meter``, issue 6). Raises ``LedgerUnavailable``."""

    @abstractmethod
    async def close(self) -> None:
        """Release connections."""

    async def __aenter__(self) -> Ledger:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def usage_from_events(
    tenant: str, window_s: float, events: list[Event], open_count: int, by_status: dict[str, int]
) -> TenantUsage:
    """Sum an event list into a ``TenantUsage``."""
    return TenantUsage(
        tenant=tenant,
        window_s=window_s,
        requests=sum(e.requests for e in events),
        input_tokens=sum(e.input_tokens for e in events),
        output_tokens=sum(e.output_tokens for e in events),
        gpu_ms=sum(e.gpu_ms for e in events),
        overage_gpu_ms=sum(e.overage_gpu_ms for e in events),
        open_reservations=open_count,
        by_status=by_status,
    )
