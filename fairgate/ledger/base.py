"""The ledger's interfaces, split by who calls them, and the ids every backend makes.

- ``RequestPath``: what serving one request needs - reserve (which also returns the balances behind the
  rate-limit headers, and takes the run claim when asked: which gateway process runs it), claim (the run claim
  alone: renewed while the request runs), settle, cancel, enqueue, dequeue, get, account (the balances, read on
  their own) and heartbeat (the request is still running).
  ``ResilientLedger`` (``emergency.py``) implements it too, applying each tier's outage policy.
- ``Operator``: what an operator (the ``fairgate ledger`` commands, the admin API, reconciliation) asks:
  usage, reservations, events, freeze / unfreeze / frozen.
- ``Coordination``: what gateway processes sharing one ledger do together: expire_due (the liveness sweep
  every process runs, which expires the reservations of processes that died; ``fairgate ledger sweep``
  runs one pass of it), add_charges (shared fair-policy counters) and share_occupancy (shared replica
  occupancy for the live meters).
- ``Ledger``: all three, the quota configuration, and ``close``: what ``connect`` returns and every
  backend implements (``backend.Backend`` holds what they implement alike).
"""

from __future__ import annotations

import hashlib
import uuid
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable

from fairgate.ledger.config import TENANT_ACCOUNT, Limits, Quotas
from fairgate.ledger.model import Event, Reservation, RunClaim, TenantUsage, UnknownTenant, Usage
from fairgate.ledger.rules import Account, ReserveArgs

# An execution registry: is the request behind this reservation still running?
IsRunning = Callable[[Reservation], Awaitable[bool]]
# Charges booked with a fair policy: (GPU ms, prompt tokens, output tokens).
ChargeTotals = tuple[float, int, int]
# A reservation's status, as ``reservations(status=...)`` takes it.
STATUSES = ("open", "settled", "cancelled", "expired")


def tenant_tag(tenant: str) -> str:
    """A stable 16-hex-digit hash of the tenant (used in ids, Redis hash slots and metric labels)."""
    return hashlib.sha256(tenant.encode()).hexdigest()[:16]


def new_reservation_id(tenant: str) -> str:
    """``<tenant tag>-<random 32 hex>``: the tag lets a sharded backend find the tenant from the id."""
    return f"{tenant_tag(tenant)}-{uuid.uuid4().hex}"


class RequestPath(ABC):
    """What serving one request needs. All amounts are cumulative where they describe usage:
    ``settle(..., input_tokens=100, output_tokens=40, ...)`` means 100 and 40 *so far*, so a repeated call
    changes nothing. Tokens are counts, GPU times ms."""

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
        claim_owner: str | None = None,
        claim_lease_ms: float = 0.0,
    ) -> Reservation:
        """Reserve every dimension for one request, atomically, once per ``(tenant, request_id)``.

        The reservation is checked against, and charged to, the tenant-wide account (the tenant's own limits,
        every model class counted) and, when the tenant's quota has a table for ``model_class``, that class's
        account too (its merged limits): a class's limits cap inside the tenant's, never beyond them
        (``TenantQuota.accounts``). Settle, cancel, expiry, enqueue and dequeue update every account it was
        charged to. Run limits apply per ``run_id``, whatever the class.

        The same ``request_id`` with the same arguments returns the original reservation (whatever its
        status now) and deducts nothing - except a reservation cancelled with nothing billed (``Usage()``:
        it never ran, since a request that ran bills its prompt at least), which it re-opens: same id,
        charged again as a new reservation (``QuotaExceeded`` leaves it cancelled), a new TTL and a
        ``reserve`` event. With other arguments it raises ``IdempotencyConflict``.

        The reservation returned carries ``balances``: what ``account(tenant, model_class)`` would read right
        after this call (the binding account as written; a backend's view when it returns an earlier
        reservation), read in the same round trip, so the rate-limit headers need no second call.

        With ``claim_owner``, the same call also takes the run claim for that gateway process, for
        ``claim_lease_ms`` (as ``claim(reservation.id, claim_owner, claim_lease_ms)`` would right after, in the same
        transaction: ``rules.claim_on_reserve``), and the reservation carries it as it stands
        (``Reservation.claim``; None on a final reservation, which is not claimed). A refusal writes no claim.

        Raises:
            QuotaExceeded, IdempotencyConflict, InvalidUsage (also a bad owner or lease), UnknownTenant,
            LedgerUnavailable.
        """
        args = ReserveArgs(
            tenant, request_id, input_tokens, max_output_tokens, gpu_ms_estimate, model_class, run_id, tool_round
        )
        return await self.reserve_args(args, claim_owner, claim_lease_ms)

    @abstractmethod
    async def reserve_args(
        self, args: ReserveArgs, claim_owner: str | None = None, claim_lease_ms: float = 0.0
    ) -> Reservation:
        """``reserve`` with its arguments in one record (unchecked: the implementation checks them).
        Raises as ``reserve``."""

    @abstractmethod
    async def claim(self, reservation_id: str, owner: str, lease_ms: float) -> RunClaim:
        """Take or renew the run claim on an open reservation for gateway process ``owner``, for ``lease_ms``
        from now (ledger clock), unless another process holds it unlapsed; either way return the claim as it
        stands, so ``claim(...).held_by(owner)`` says whether ``owner`` may run the request. A claim taken
        also records a heartbeat (``heartbeat``). Closing the reservation ends its claim.

        A reservation returns to every process that reserves its request id again (``reserve``); the claim
        is what keeps a request from running on two processes at once.

        Raises:
            ReservationNotFound, ReservationFinal (closed already), InvalidUsage (a bad owner or lease),
            LedgerUnavailable.
        """

    @abstractmethod
    async def settle(
        self, reservation_id: str, input_tokens: int, output_tokens: int, gpu_ms: float, final: bool = False
    ) -> Reservation:
        """Bill cumulative usage; ``final`` closes the reservation and releases the unused remainder.

        A final settle repeated with the same amounts returns the same reservation.

        Raises:
            ReservationNotFound, ReservationFinal, InvalidUsage, SettlementFrozen, UnknownTenant,
            LedgerUnavailable.
        """

    @abstractmethod
    async def cancel(self, reservation_id: str, consumed: Usage) -> Reservation:
        """Close the reservation billing ``consumed`` (prompt and tokens generated so far), releasing the rest.

        Raises:
            ReservationNotFound, ReservationFinal, InvalidUsage, SettlementFrozen, UnknownTenant,
            LedgerUnavailable.
        """

    @abstractmethod
    async def enqueue(self, reservation_id: str) -> Reservation | None:
        """The request behind ``reservation_id`` waits for an upstream slot: take a place in its tenant's
        queue (``max_queued``, global). Idempotent; a no-op on a final reservation. Returns the reservation
        (a backend always does; None: nothing was recorded, as a ``ResilientLedger`` does in an outage).

        Raises:
            QuotaExceeded (``max_queued``), ReservationNotFound, InvalidUsage (not an id), LedgerUnavailable.
        """

    @abstractmethod
    async def dequeue(self, reservation_id: str) -> Reservation | None:
        """The queued request got an upstream slot: give its queue place back. Idempotent; a no-op when it
        holds none (the final settlement gives a place back too). Returns as ``enqueue``.

        Raises:
            ReservationNotFound, InvalidUsage (not an id), LedgerUnavailable.
        """

    @abstractmethod
    async def get(self, reservation_id: str) -> Reservation:
        """The reservation. Raises ``ReservationNotFound``, ``InvalidUsage`` (not an id), ``LedgerUnavailable``."""

    @abstractmethod
    async def account(self, tenant: str, model_class: str = "default") -> Account:
        """The balances that bind for ``tenant``'s requests in ``model_class`` now (as last written; buckets
        not refilled), against ``Quotas.tenant(tenant).for_model_class(model_class)``: the class's own account
        when the tenant's quota has a table for it, else the tenant-wide one (``TENANT_ACCOUNT``, ``"*"``,
        which ``model_class="*"`` names). Raises ``LedgerUnavailable``.

        A ledger written before tenant-wide accounts kept every class's balances under the class name: those
        of a class with a table of its own carry on; the tenant-wide account starts fresh (full buckets, no
        slot or GPU time held), and reservations open at the upgrade give back to it what they never took
        from it (floored at zero)."""

    @abstractmethod
    async def heartbeat(self, reservation_id: str) -> None:
        """Record that the request behind ``reservation_id`` is running now (the default registry of
        ``expire_due``); a no-op once the reservation is final.

        Raises:
            ReservationNotFound, InvalidUsage (not an id), LedgerUnavailable.
        """


class Operator(ABC):
    """What an operator asks of the ledger: usage, the records, and freezing settlement."""

    @abstractmethod
    async def usage(self, tenant: str, window_s: float) -> TenantUsage:
        """The tenant's billed usage over the last ``window_s`` seconds, and its reservations by status.
        Raises ``InvalidUsage`` (a bad tenant, a window not in (0, 10 years]), ``LedgerUnavailable``."""

    @abstractmethod
    async def reservations(self, tenant: str | None = None, status: str | None = None) -> list[Reservation]:
        """Reservations ordered by ``created_ms`` then id, optionally of one tenant and/or status (one of
        ``STATUSES``). Raises ``InvalidUsage`` (a bad tenant or status), ``LedgerUnavailable``."""

    @abstractmethod
    async def events(self, tenant: str | None = None) -> list[Event]:
        """The usage event log in order, optionally of one tenant. Raises ``InvalidUsage``, ``LedgerUnavailable``."""

    @abstractmethod
    async def freeze(self, tenant: str, reason: str) -> None:
        """Stop automatic settlement for ``tenant`` (reconciliation found a difference): settle and cancel
        raise ``SettlementFrozen``, ``expire_due`` skips it. Raises ``LedgerUnavailable``."""

    @abstractmethod
    async def unfreeze(self, tenant: str) -> None:
        """Resume automatic settlement for ``tenant``. Raises ``LedgerUnavailable``."""

    @abstractmethod
    async def frozen(self) -> dict[str, str]:
        """Frozen tenants (sorted by name) and why. Raises ``LedgerUnavailable``."""


class Coordination(ABC):
    """What gateway processes sharing one ledger do together."""

    @abstractmethod
    async def expire_due(self, is_running: IsRunning | None = None) -> list[Reservation]:
        """One sweeper pass: for each open reservation past its TTL, ask ``is_running``, and extend the
        running ones by a TTL from now; by default (no ``is_running``) a reservation heartbeat within the
        TTL runs, and is extended to a TTL after that heartbeat - so a dead process's reservation is
        expired by the first sweep a TTL after its last heartbeat. Expire the others (billing what was
        settled so far). Tenants frozen are skipped. Returns the reservations expired.

        Raises:
            UnknownTenant (a tenant no longer configured), LedgerUnavailable.
        """

    @abstractmethod
    async def add_charges(self, scope: str, deltas: dict[str, ChargeTotals]) -> dict[str, ChargeTotals]:
        """Add ``deltas`` (tenant -> (GPU ms, prompt tokens, output tokens) charged by this process's policy
        since its last call) to the shared totals of ``scope`` (a model's pool), atomically; return every
        tenant's totals in that scope after the addition. This is how gateway processes sharing a ledger
        share the counters their fair policies read. Raises ``LedgerUnavailable``."""

    @abstractmethod
    async def share_occupancy(
        self, process: str, occupancy: dict[str, tuple[float, float]], stale_after_ms: float
    ) -> dict[str, tuple[float, float]]:
        """Publish gateway process ``process``'s occupancy of its upstreams - upstream (its URL) ->
        (sequences in the iteration, share of the upstream's time spent prefilling them), averaged over its
        last round - replacing what it published before, and counted for ``stale_after_ms`` (ledger clock)
        unless published again; return, per upstream, the sum over every *other* process's publication still
        counted. This is how the live meters of processes sharing a replica split its busy time between
        them (``fairgate.core.meter``). Raises ``LedgerUnavailable``."""


class Ledger(RequestPath, Operator, Coordination):
    """The whole ledger on one backend (``connect`` picks it by URL), with its quota configuration."""

    def __init__(self, quotas: Quotas) -> None:
        self.quotas = quotas

    def apply_quotas(self, quotas: Quotas) -> None:
        """Check every call from now on against ``quotas`` (a configuration reload): a reservation made under
        the old limits is settled, cancelled and expired under the new ones, on the levels its accounts
        hold; a tenant absent from ``quotas`` keeps its booked usage, can reserve and settle no more
        (``UnknownTenant``), and its open reservations expire (``closing_books``)."""
        self.quotas = quotas

    def limits(self, tenant: str, model_class: str) -> Limits:
        """The tenant's limits for ``model_class`` (``TenantQuota.for_model_class``: its run limits and TTL).
        Raises ``UnknownTenant``."""
        try:
            return self.quotas.tenant(tenant).for_model_class(model_class)
        except KeyError:
            raise UnknownTenant(f"tenant {tenant!r} has no quota configuration") from None

    def books(self, tenant: str, model_class: str) -> tuple[tuple[str, Limits], ...]:
        """The accounts a reservation of ``tenant`` in ``model_class`` is charged to, with their limits
        (``TenantQuota.accounts``). Raises ``UnknownTenant``."""
        try:
            return self.quotas.tenant(tenant).accounts(model_class)
        except KeyError:
            raise UnknownTenant(f"tenant {tenant!r} has no quota configuration") from None

    def closing_limits(self, tenant: str, model_class: str) -> Limits:
        """``limits``, or for a tenant no longer configured here no limit at all (``Limits()``, its default
        TTL): what the sweep's expiry needs - it must expire such reservations, not stop at them (another
        process's tenant while a reload reaches every process, or one removed by a restart)."""
        quota = self.quotas.tenants.get(tenant)
        return Limits() if quota is None else quota.for_model_class(model_class)

    def closing_books(self, tenant: str, model_class: str) -> tuple[tuple[str, Limits], ...]:
        """``books``, or for a tenant no longer configured here its tenant-wide account with no limit (as
        ``closing_limits``)."""
        quota = self.quotas.tenants.get(tenant)
        return ((TENANT_ACCOUNT, Limits()),) if quota is None else quota.accounts(model_class)

    def account_keys(self, tenant: str, model_class: str) -> list[str]:
        """The keys of ``books`` (for a tenant no longer configured: the tenant-wide account's)."""
        quota = self.quotas.tenants.get(tenant)
        return [TENANT_ACCOUNT] if quota is None else [key for key, _ in quota.accounts(model_class)]

    def account_key(self, tenant: str, model_class: str) -> str:
        """The key of the account that binds for ``model_class``: the last of ``account_keys``."""
        return self.account_keys(tenant, model_class)[-1]

    @abstractmethod
    async def close(self) -> None:
        """Release connections."""

    async def __aenter__(self) -> Ledger:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


__all__ = [
    "STATUSES",
    "ChargeTotals",
    "Coordination",
    "Event",
    "IsRunning",
    "Ledger",
    "Operator",
    "RequestPath",
    "RunClaim",
    "new_reservation_id",
    "tenant_tag",
]
