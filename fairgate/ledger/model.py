"""Plain data of the ledger: reservations, usage, and the typed errors.

Error tree (``LedgerError`` is the base of all):

- ``QuotaExceeded`` - a dimension would go over its limit; nothing was reserved.
- ``IdempotencyConflict`` - the request id was used before with other arguments.
- ``ReservationNotFound`` - no reservation with that id.
- ``ReservationFinal`` - the reservation was settled, cancelled or expired already (with other values).
- ``InvalidUsage`` - negative, non-integer or impossible amounts (e.g. output above the reservation).
- ``SettlementFrozen`` - reconciliation froze automatic settlement for the tenant.
- ``UnknownTenant`` - the tenant has no quota configuration.
- ``LedgerUnavailable`` - the backend cannot be reached (the caller applies the tier's policy).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Status = Literal["open", "settled", "cancelled", "expired"]


class LedgerError(Exception):
    """Base of every ledger error."""


class QuotaExceeded(LedgerError):
    """``dimension`` would exceed its limit. ``retry_after_s`` is when it frees (None: not by waiting)."""

    def __init__(
        self,
        tenant: str,
        dimension: str,
        retry_after_s: float | None,
        limit: float | None = None,
        remaining: float | None = None,
    ) -> None:
        self.tenant, self.dimension, self.retry_after_s = tenant, dimension, retry_after_s
        self.limit, self.remaining = limit, remaining
        when = "not by waiting" if retry_after_s is None else f"retry after {retry_after_s:.3f} s"
        super().__init__(f"tenant {tenant!r}: quota {dimension} exceeded ({when})")


class IdempotencyConflict(LedgerError):
    """The same request id was reserved before with different arguments."""


class ReservationNotFound(LedgerError):
    """No reservation with that id."""


class ReservationFinal(LedgerError):
    """The reservation is final already and the call asks for something else."""


class InvalidUsage(LedgerError, ValueError):
    """Amounts that cannot be booked (negative, non-integer, output above the reservation, decreasing)."""


class SettlementFrozen(LedgerError):
    """Automatic settlement is frozen for the tenant until an operator reviews the reconciliation."""


class UnknownTenant(LedgerError, KeyError):
    """The tenant has no quota configuration."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown tenant"


class LedgerUnavailable(LedgerError):
    """The backend could not be reached or did not answer."""


@dataclass(frozen=True)
class Usage:
    """Billed totals so far: the cumulative amounts a settlement or cancel reports."""

    input_tokens: int = 0
    output_tokens: int = 0
    gpu_ms: float = 0.0


@dataclass
class Account:
    """Balances of one account of a tenant: its tenant-wide account or a model class's
    (``TenantQuota.accounts``). Bucket levels are in units (requests, tokens); times are ms on the ledger
    clock; GPU amounts are ms."""

    requests_level: float | None = None  # None: not yet initialised (starts full)
    requests_updated_ms: float = 0.0
    input_level: float | None = None
    input_updated_ms: float = 0.0
    output_level: float | None = None
    output_updated_ms: float = 0.0
    concurrent: int = 0
    gpu_window_start_ms: float = 0.0
    gpu_window_used_ms: float = 0.0
    gpu_total_used_ms: float = 0.0
    queued: int = 0  # queue places taken: requests waiting for an upstream slot (``enqueue``)
    spend_period_start_ms: float = 0.0  # the spend period counted (``periods.period_start_ms``)
    spend_used_micros: float = 0.0  # spend held and billed in that period, micros (1e-6) of the currency


@dataclass(frozen=True)
class Price:
    """What one unit of usage costs, in micros (1e-6) of the pricing currency: the prices of a model class
    (``[pricing.model_class.NAME]``, seed 003: "use benchmarked inference units for pricing, but still display
    user-understandable tokens, concurrency, and amounts"). A price per million tokens in the currency is
    micros per token; a price per GPU-second is 1,000 micros per GPU-ms for each unit of the currency.

    A reservation keeps the price it was made at (``Reservation.price``): a reload that changes prices
    bills requests in flight at the price they were admitted at, so settlement gives back exactly what
    the reservation took."""

    input_micros_per_token: float = 0.0
    output_micros_per_token: float = 0.0
    gpu_micros_per_ms: float = 0.0

    def spend_micros(self, input_tokens: float, output_tokens: float, gpu_ms: float) -> float:
        """Micros these amounts cost. Evaluated left to right, as ``prelude.lua``'s ``spend_of`` does, so
        every backend books the same double."""
        return (
            input_tokens * self.input_micros_per_token
            + output_tokens * self.output_micros_per_token
            + gpu_ms * self.gpu_micros_per_ms
        )


FREE = Price()  # what a class without a price costs, and a reservation made before prices were booked


@dataclass(frozen=True)
class Reservation:
    """A reservation and what has been billed against it.

    Attributes:
        id: reservation id (contains the tenant's hash, so a backend can find its shard).
        tenant / request_id / model_class / run_id: what was reserved, for whom.
        input_tokens / max_output_tokens / gpu_ms_estimate: the admitted (reserved) units.
        price: the model class's ``Price`` when reserved; the spend held and billed is priced by it.
        status: ``open`` until a final settle (``settled``), a cancel (``cancelled``) or expiry (``expired``).
        billed: cumulative usage billed so far.
        overage_gpu_ms: GPU ms billed above the estimate (booked, never dropped).
        created_ms / expires_at_ms / final_ms: ledger-clock times, ms since the epoch.
        balances: on what ``reserve`` returns, the balances that bind for the request right after the call
            (what ``account(tenant, model_class)`` reads then: the rate-limit headers need no second read);
            None on what any other call returns, and on an emergency grant. Not part of the record: left out
            of equality and ``repr``.
        claim: on what ``reserve(..., claim_owner=...)`` returns, the run claim as it stands after the call
            (``rules.claim_on_reserve``: taken or renewed for the owner unless another holds it unlapsed);
            None when no claim was asked, on a final reservation (nothing claimed), and where the call could
            not ask the ledger (an emergency grant already in the ledger, one answered from memory in an
            outage): the caller then asks ``claim``. Not part of the record, as ``balances``.
    """

    id: str
    tenant: str
    request_id: str
    model_class: str
    run_id: str | None
    tool_round: bool
    input_tokens: int
    max_output_tokens: int
    gpu_ms_estimate: float
    status: Status
    billed: Usage
    overage_gpu_ms: float
    created_ms: float
    expires_at_ms: float
    final_ms: float | None = None
    queued: bool = False  # holds a place in its tenant's queue (``Ledger.enqueue`` .. ``dequeue``)
    price: Price = FREE  # the model class's price when reserved (``Price``): what settlement bills at
    balances: Account | None = field(default=None, compare=False, repr=False)
    claim: RunClaim | None = field(default=None, compare=False, repr=False)

    @property
    def is_final(self) -> bool:
        """Settled, cancelled or expired: nothing more is billed to it."""
        return self.status != "open"


@dataclass(frozen=True)
class RunClaim:
    """Who runs the request behind an open reservation: the run claim, held by one gateway process.

    A process takes the claim before it runs a request and renews it while the request runs; another
    process asking for it while it is held is told who holds it and for how long, so one request id is
    never run by two processes at once (seed 003: "the same request is not double-deducted").

    Attributes:
        owner: the holding process's id.
        until_ms: when the claim lapses unless renewed (ledger clock, ms since the epoch).
        now_ms: the ledger clock when the claim was read.
    """

    owner: str
    until_ms: float
    now_ms: float

    def held_by(self, owner: str) -> bool:
        """``owner`` holds the claim (it was taken or renewed for it)."""
        return self.owner == owner

    @property
    def remaining_ms(self) -> float:
        """How long the claim is held from ``now_ms`` on (0 when it has lapsed)."""
        return max(0.0, self.until_ms - self.now_ms)


# How a stored reservation names its ``Price`` (SQL columns, Redis JSON; absent in records older than prices: 0).
PRICE_FIELDS = ("price_input_micros", "price_output_micros", "price_gpu_micros")


def reservation_from_record(
    record: Mapping[str, Any], whole: Callable[[Any], int], flag: Callable[[Any], bool], balances: Account | None = None
) -> Reservation:
    """A ``Reservation`` from a stored record: its fields by name, ``billed`` as ``billed_input_tokens``,
    ``billed_output_tokens``, ``billed_gpu_ms`` (the SQL columns and the Redis JSON alike); ``run_id``,
    ``final_ms`` and ``queued`` may be absent. ``whole`` and ``flag`` read the backend's integers and
    booleans; times and GPU ms are read with ``float``. ``balances``: ``Reservation.balances``."""
    final_ms = record.get("final_ms")
    return Reservation(
        id=record["id"],
        tenant=record["tenant"],
        request_id=record["request_id"],
        model_class=record["model_class"],
        run_id=record.get("run_id"),
        tool_round=flag(record["tool_round"]),
        input_tokens=whole(record["input_tokens"]),
        max_output_tokens=whole(record["max_output_tokens"]),
        gpu_ms_estimate=float(record["gpu_ms_estimate"]),
        status=record["status"],
        billed=Usage(
            whole(record["billed_input_tokens"]), whole(record["billed_output_tokens"]), float(record["billed_gpu_ms"])
        ),
        overage_gpu_ms=float(record["overage_gpu_ms"]),
        created_ms=float(record["created_ms"]),
        expires_at_ms=float(record["expires_at_ms"]),
        final_ms=None if final_ms is None else float(final_ms),
        queued=flag(record.get("queued")),
        price=Price(*(float(record.get(name) or 0.0) for name in PRICE_FIELDS)),
        balances=balances,
    )


@dataclass(frozen=True)
class TenantUsage:
    """A tenant's usage over a window, from the event log.

    Attributes:
        requests: reservations made; input/output tokens and GPU ms billed; overage GPU ms;
        by_status: its reservations now by status, whatever the window (statuses with none left out);
        rejections are counted by the gateway.
    """

    tenant: str
    window_s: float
    requests: int
    input_tokens: int
    output_tokens: int
    gpu_ms: float
    overage_gpu_ms: float
    by_status: dict[str, int]
    spend_micros: float = 0.0  # what the billed usage cost at each reservation's price (``Price``)

    @property
    def open_reservations(self) -> int:
        """Reservations still open now."""
        return self.by_status.get("open", 0)


@dataclass(frozen=True)
class Event:
    """One row of the usage event log: what a call billed (deltas of the cumulative billed usage).

    Tokens are counts, GPU times ms, ``at_ms`` ms since the epoch on the ledger clock.
    """

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
    spend_micros: float = 0.0  # what the billed delta cost at its reservation's price


def usage_from_events(tenant: str, window_s: float, events: list[Event], by_status: dict[str, int]) -> TenantUsage:
    """Sum the events of ``tenant`` over a window into a ``TenantUsage``; ``by_status``: its reservations
    by status (statuses with none left out)."""
    return TenantUsage(
        tenant=tenant,
        window_s=window_s,
        requests=sum(e.requests for e in events),
        input_tokens=sum(e.input_tokens for e in events),
        output_tokens=sum(e.output_tokens for e in events),
        gpu_ms=sum(e.gpu_ms for e in events),
        overage_gpu_ms=sum(e.overage_gpu_ms for e in events),
        by_status=by_status,
        spend_micros=sum(e.spend_micros for e in events),
    )


def check_name(value: object, field: str, optional: bool = False) -> str | None:
    """A tenant, request id, model class or run id: a non-empty string of at most 200 characters, printable
    UTF-8 (no NUL, control or invisible format characters - U+202E, U+200B, ... - no lone surrogates).
    Returns it (None when ``optional`` and None). Raises ``InvalidUsage`` naming ``field``."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value or len(value) > 200:
        raise InvalidUsage(f"{field} must be a non-empty string of at most 200 characters, got {value!r:.80}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidUsage(f"{field} is not valid UTF-8 text: {value!r:.80}") from None
    if not value.replace(" ", "x").isprintable():  # controls (C0, C1), format characters, line separators
        raise InvalidUsage(f"{field} contains a control character: {value!r:.80}")
    return value
