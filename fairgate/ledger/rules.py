"""The ledger's semantics as pure functions over plain state (no I/O, no clock: ``now_ms`` is passed in).

SQLite runs these inside one transaction per call; PostgreSQL's server-side functions
(``postgres_functions.sql``) and the Redis backend's Lua scripts (``redis/scripts/*.lua``) implement the same
rules, operation for operation, and the conformance suite holds all three to them.

Semantics (``shared/DESIGN.md`` "Ledger semantics"; seed 003; two-phase transfers as in TigerBeetle,
idempotency keys as in Stripe's API):

- A reservation is checked against, and charged to, every account of ``TenantQuota.accounts``: the
  tenant-wide one (the tenant's limits, every model class counted) and, for a class with limits of its
  own, the class's; each call below updates every account the reservation was charged to. Run limits are
  per agent run (the class's limits), whatever the class.
- ``reserve`` checks every dimension of the quota vector on every account and, only if all fit, deducts
  them all.
- While a reservation is open the account *holds* ``max(estimate, billed)`` of each dimension: GPU time
  billed above the estimate is booked at once as overage, never dropped.
- The final settlement (or cancel, or expiry) replaces what is held by what was billed: the unused
  remainder returns to the buckets, the concurrency slot is released.
- A request that has to wait for an upstream slot takes a queue place (``enqueue``; ``max_queued``,
  global across gateway processes) until ``dequeue`` (it got a slot) or its final settlement, whichever
  comes first; one dispatched at once never takes one. ``max_concurrent`` counts every open reservation.
- A retry of a request id returns its reservation as it is (whatever its status) - except one cancelled
  with nothing billed (it never ran: a request that ran bills its prompt at least), which the retry
  re-opens (``reopens``) and which is charged as a new reservation.
- Token buckets refill continuously up to their burst; elapsed time is never negative (a clock behind
  the last update reads as no time passed). The arithmetic is ``fairgate.core.ratelimit``'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

from fairgate.core import ratelimit
from fairgate.ledger.config import Limits
from fairgate.ledger.model import (
    FREE,
    IdempotencyConflict,
    InvalidUsage,
    Price,
    QuotaExceeded,
    Reservation,
    ReservationFinal,
    RunClaim,
    Status,
    Usage,
)
from fairgate.ledger.model import Account as Account  # the balances the rules work on, defined with the data
from fairgate.ledger.periods import next_period_start_ms, period_start_ms

MS_PER_MINUTE = 60_000.0
# A worst case that fits the spend budget to within a thousandth of a micro fits it: prices such as 0.1 or 1.1 per
# million tokens are not exact doubles, and a budget of exactly N requests must admit the N-th.
SPEND_SLACK_MICROS = 1e-3
CONCURRENCY_RETRY_S = 1.0  # a slot frees when some request ends: unknown, so suggest a short wait
QUEUE_RETRY_S = 2.0  # a queue place frees when a queued request is dispatched
# The status a final call of each kind leaves.
STATUS_OF_KIND: dict[str, Status] = {"settle": "settled", "cancel": "cancelled", "expire": "expired"}


# An account with the limits it is checked against (``TenantQuota.accounts``, in that order).
Book = tuple[Account, Limits]


@dataclass
class RunUsage:
    """Counters of one agent run."""

    model_calls: int = 0
    tool_rounds: int = 0
    tokens: int = 0


@dataclass(frozen=True)
class ReserveArgs:
    """The arguments that identify a reservation (a retry must repeat them exactly)."""

    tenant: str
    request_id: str
    input_tokens: int
    max_output_tokens: int
    gpu_ms_estimate: float
    model_class: str
    run_id: str | None
    tool_round: bool
    price: Price = FREE  # the class's price (``Backend.reserve_args`` sets it); not part of the fingerprint

    @classmethod
    def of(cls, r: Reservation) -> ReserveArgs:
        """The arguments ``r`` was reserved with."""
        return cls(**{f.name: getattr(r, f.name) for f in fields(cls)})

    def fingerprint(self) -> tuple[object, ...]:
        """What a retry must repeat (the tenant and request id are the key)."""
        return (
            self.input_tokens,
            self.max_output_tokens,
            float(self.gpu_ms_estimate),
            self.model_class,
            self.run_id,
            self.tool_round,
        )


@dataclass(frozen=True)
class Delta:
    """What one call billed (event log row): differences of the cumulative billed usage (``billed``: the
    tokens and GPU ms it added), of the overage booked and of the spend."""

    kind: str  # reserve | settle | settle_final | cancel | expire
    requests: int = 0
    billed: Usage = field(default_factory=Usage)
    overage_gpu_ms: float = 0.0
    spend_micros: float = 0.0


# Bounds on one request: far above any real model (a 10M-token context, a GPU-day), far below where
# numbers lose precision (Redis keeps doubles: integers are exact below 2**53).
MAX_TOKENS_PER_CALL = 10_000_000
MAX_GPU_MS_PER_CALL = 86_400_000.0
# The least GPU time that is not 0: times any price (0 or at least 1e-9 a unit) it stays a normal double, which
# PostgreSQL's float8 needs (it raises on a product that underflows to 0, where Python rounds; an outside tester
# passed 5e-324). Far below anything a meter charges.
MIN_GPU_MS_PER_CALL = 1e-300


def check_amounts(input_tokens: object, output_tokens: object, gpu_ms: object, what: str) -> None:
    """Raise ``InvalidUsage`` unless the token counts are ints in [0, MAX_TOKENS_PER_CALL] and ``gpu_ms`` 0 or a
    number in [MIN_GPU_MS_PER_CALL, MAX_GPU_MS_PER_CALL]."""
    for name, value in (
        ("input_tokens", input_tokens),
        (f"{'max_' if what == 'reserve' else ''}output_tokens", output_tokens),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKENS_PER_CALL:
            raise InvalidUsage(f"{what}: {name} must be an integer from 0 to {MAX_TOKENS_PER_CALL:,}, got {value!r}")
    if (
        isinstance(gpu_ms, bool)
        or not isinstance(gpu_ms, int | float)
        or not (gpu_ms == 0 or MIN_GPU_MS_PER_CALL <= gpu_ms <= MAX_GPU_MS_PER_CALL)
    ):
        raise InvalidUsage(
            f"{what}: gpu_ms must be 0 or a number from {MIN_GPU_MS_PER_CALL:g} to {MAX_GPU_MS_PER_CALL:,.0f}, "
            f"got {gpu_ms!r}"
        )


def input_allowance(reserved_input_tokens: int) -> int:
    """The most input tokens a settlement bills for a reservation of ``reserved_input_tokens`` before it is
    flagged (``reconcile`` lists it, the gateway logs it): what the tenant used is billed whatever it is
    (up to ``MAX_TOKENS_PER_CALL``), but this far above the estimate the estimate missed part of the prompt.

    The reservation's input count is the gateway's estimate; the model's tokenizer and chat template may
    count more. Twice the estimate plus 1,024 covers the ordinary differences.
    """
    return 2 * reserved_input_tokens + 1024


def refreshed(account: Account, limits: Limits, now_ms: float) -> Account:
    """The account with buckets refilled and the GPU window and spend period rolled forward to ``now_ms``."""
    out = replace(account)
    for dimension, prefix in (("requests", "requests"), ("input_tokens", "input"), ("output_tokens", "output")):
        rate = getattr(limits, f"{dimension}_per_minute")
        if rate is None:
            continue
        level, updated = ratelimit.refill(
            getattr(out, f"{prefix}_level"),
            getattr(out, f"{prefix}_updated_ms"),
            now_ms,
            rate,
            limits.burst(dimension) or 0.0,
            MS_PER_MINUTE,
        )
        setattr(out, f"{prefix}_level", level)
        setattr(out, f"{prefix}_updated_ms", updated)
    window_ms = limits.gpu_window_s * 1000.0
    if now_ms >= out.gpu_window_start_ms + window_ms:
        # Windows are aligned to multiples of their length since the epoch; open reservations' holds
        # stay booked in the window they were made in.
        out.gpu_window_start_ms = now_ms - (now_ms % window_ms)
        out.gpu_window_used_ms = 0.0
    # Calendar periods: only forward (a clock behind the period counted reads as the same period).
    start_ms = period_start_ms(now_ms, limits.spend_period)
    if start_ms > out.spend_period_start_ms:
        out.spend_period_start_ms = start_ms
        out.spend_used_micros = 0.0
    return out


def _bucket_wait_s(level: float, need: float, rate_per_minute: float) -> float:
    return ratelimit.wait(level, need, rate_per_minute, per=60.0)


def reserve(
    books: Sequence[Book], run: RunUsage | None, args: ReserveArgs, now_ms: float, again: bool = False
) -> tuple[list[Account], RunUsage | None]:
    """Admit ``args`` against every dimension of every account, atomically: returns the new accounts (in the
    order of ``books``: ``TenantQuota.accounts``) and run counters. Run limits are the last book's (the
    class's limits). ``again``: a re-open (``reopens``) - the request was counted (``requests_per_minute``,
    the run's model calls and tool rounds) when first reserved, and a cancel gives none of that back, so it
    is not counted twice; what the cancel gave back (tokens, concurrency, GPU time) is charged again.

    Checked in this order (the Redis script too), each on every account in turn: request size and rates
    (request size, request rate, input and output token rates), concurrency, GPU budgets, the spend budget
    (what the worst case costs at ``args.price``: the prompt, every output token, the GPU estimate); then run
    limits.

    Raises:
        InvalidUsage: negative or non-integer amounts.
        QuotaExceeded: the first dimension (in the order checked) that does not fit.
    """
    check_amounts(args.input_tokens, args.max_output_tokens, args.gpu_ms_estimate, "reserve")
    refreshed_books = [(refreshed(account, limits, now_ms), limits) for account, limits in books]
    for acc, limits in refreshed_books:
        _check_size_and_rates(acc, limits, args, again)
    for acc, limits in refreshed_books:
        if limits.max_concurrent is not None and acc.concurrent >= limits.max_concurrent:
            raise QuotaExceeded(args.tenant, "max_concurrent", CONCURRENCY_RETRY_S, limits.max_concurrent, 0)
    estimate = float(args.gpu_ms_estimate)
    for acc, limits in refreshed_books:
        _check_gpu(acc, limits, args.tenant, estimate, now_ms)
    spend = args.price.spend_micros(args.input_tokens, args.max_output_tokens, estimate)
    for acc, limits in refreshed_books:
        _check_spend(acc, limits, args.tenant, spend, now_ms)
    new_run = None if args.run_id is None else _counted_run(run or RunUsage(), books[-1][1], args, again)
    for acc, _ in refreshed_books:
        if acc.requests_level is not None and not again:
            acc.requests_level -= 1.0
        if acc.input_level is not None:
            acc.input_level -= args.input_tokens
        if acc.output_level is not None:
            acc.output_level -= args.max_output_tokens
        acc.concurrent += 1
        acc.gpu_window_used_ms += estimate
        acc.gpu_total_used_ms += estimate
        acc.spend_used_micros += spend
    return [acc for acc, _ in refreshed_books], new_run


def _check_size_and_rates(acc: Account, limits: Limits, args: ReserveArgs, again: bool) -> None:
    """``max_tokens_per_request``, then the request (unless ``again``) and token buckets (refreshed)."""
    tenant = args.tenant
    tokens = args.input_tokens + args.max_output_tokens
    if limits.max_tokens_per_request is not None and tokens > limits.max_tokens_per_request:
        raise QuotaExceeded(tenant, "max_tokens_per_request", None, limits.max_tokens_per_request, 0)
    if limits.requests_per_minute is not None and not again:
        assert acc.requests_level is not None
        if acc.requests_level < 1.0:
            raise QuotaExceeded(
                tenant,
                "requests_per_minute",
                _bucket_wait_s(acc.requests_level, 1.0, limits.requests_per_minute),
                limits.requests_per_minute,
                acc.requests_level,
            )
    for dimension, prefix, need in (
        ("input_tokens", "input", args.input_tokens),
        ("output_tokens", "output", args.max_output_tokens),
    ):
        rate = getattr(limits, f"{dimension}_per_minute")
        if rate is None:
            continue
        level = getattr(acc, f"{prefix}_level")
        burst = limits.burst(dimension) or 0.0
        if need > burst:
            raise QuotaExceeded(tenant, f"{dimension}_per_minute", None, rate, level)
        if level < need:
            raise QuotaExceeded(tenant, f"{dimension}_per_minute", _bucket_wait_s(level, need, rate), rate, level)


def _check_gpu(acc: Account, limits: Limits, tenant: str, estimate: float, now_ms: float) -> None:
    """The GPU budget of the window (retry when it rolls over, if the estimate fits a window at all), then
    the lifetime budget. ``remaining`` in seconds."""
    budgets = (
        ("gpu_seconds", limits.gpu_seconds, acc.gpu_window_used_ms),
        ("gpu_seconds_total", limits.gpu_seconds_total, acc.gpu_total_used_ms),
    )
    for dimension, budget_s, used_ms in budgets:
        if budget_s is None or used_ms + estimate <= budget_s * 1000.0:
            continue
        retry = None
        if dimension == "gpu_seconds" and estimate <= budget_s * 1000.0:
            window_end_ms = acc.gpu_window_start_ms + limits.gpu_window_s * 1000.0
            retry = max(0.0, (window_end_ms - now_ms) / 1000.0)
        raise QuotaExceeded(tenant, dimension, retry, budget_s, max(0.0, budget_s - used_ms / 1000.0))


def _check_spend(acc: Account, limits: Limits, tenant: str, spend_micros: float, now_ms: float) -> None:
    """The spend budget of the period (retry when the next period starts, if the worst case fits a period at
    all). ``limit`` and ``remaining`` in the currency."""
    budget = limits.spend_budget
    if budget is None or acc.spend_used_micros + spend_micros <= budget * 1e6 + SPEND_SLACK_MICROS:
        return
    retry = None
    if spend_micros <= budget * 1e6:
        retry = max(0.0, (next_period_start_ms(acc.spend_period_start_ms, limits.spend_period) - now_ms) / 1000.0)
    raise QuotaExceeded(tenant, "spend_budget", retry, budget, max(0.0, budget - acc.spend_used_micros / 1e6))


def spend_left_micros(account: Account, limits: Limits) -> float:
    """Micros of the currency the spend budget leaves this period (``account`` as ``refreshed``), holds of open
    reservations counted; ``inf`` without a budget; negative when overspent (GPU time billed above estimates)."""
    if limits.spend_budget is None:
        return math.inf
    return limits.spend_budget * 1e6 - account.spend_used_micros


def gpu_left_ms(account: Account, limits: Limits) -> float:
    """GPU ms the tenant's budgets leave (``account`` as ``refreshed`` at the time asked): the least of what
    the window's (``gpu_seconds``) and the lifetime's (``gpu_seconds_total``) leave, holds of open reservations
    counted; ``inf`` with neither set; negative when overspent."""
    left = math.inf
    for budget_s, used_ms in (
        (limits.gpu_seconds, account.gpu_window_used_ms),
        (limits.gpu_seconds_total, account.gpu_total_used_ms),
    ):
        if budget_s is not None:
            left = min(left, budget_s * 1000.0 - used_ms)
    return left


def _counted_run(run: RunUsage, limits: Limits, args: ReserveArgs, again: bool) -> RunUsage:
    """The agent run's counters with this call counted (``again``: its tokens only). Raises
    ``QuotaExceeded`` (run limits)."""
    tenant = args.tenant
    tokens = args.input_tokens + args.max_output_tokens
    if again:
        if limits.max_tokens is not None and run.tokens + tokens > limits.max_tokens:
            raise QuotaExceeded(tenant, "max_tokens", None, limits.max_tokens, max(0, limits.max_tokens - run.tokens))
        return replace(run, tokens=run.tokens + tokens)
    if limits.max_model_calls is not None and run.model_calls + 1 > limits.max_model_calls:
        raise QuotaExceeded(tenant, "max_model_calls", None, limits.max_model_calls, 0)
    if args.tool_round and limits.max_tool_rounds is not None and run.tool_rounds + 1 > limits.max_tool_rounds:
        raise QuotaExceeded(tenant, "max_tool_rounds", None, limits.max_tool_rounds, 0)
    if limits.max_tokens is not None and run.tokens + tokens > limits.max_tokens:
        raise QuotaExceeded(tenant, "max_tokens", None, limits.max_tokens, max(0, limits.max_tokens - run.tokens))
    return RunUsage(run.model_calls + 1, run.tool_rounds + (1 if args.tool_round else 0), run.tokens + tokens)


def _held(r: Reservation, billed: Usage, final: bool) -> tuple[int, int, float]:
    """Input tokens, output tokens and GPU ms the account holds for ``r`` given ``billed``."""
    if final:
        return billed.input_tokens, billed.output_tokens, billed.gpu_ms
    return (max(r.input_tokens, billed.input_tokens), r.max_output_tokens, max(r.gpu_ms_estimate, billed.gpu_ms))


def check_billing(reservation: Reservation, billed: Usage, kind: str) -> None:
    """Raise ``InvalidUsage`` unless cumulative usage ``billed`` fits the open ``reservation``: output at
    most ``max_output_tokens``, nothing below what was billed already. Checked in that order (the Redis
    scripts and the PostgreSQL functions too). Input above the reservation is billed as it is: what the engine
    read is what the tenant used (``input_allowance`` says when it is flagged)."""
    check_billed(reservation.max_output_tokens, reservation.billed, billed, kind)


def check_billed(max_output_tokens: int, before: Usage, billed: Usage, kind: str) -> None:
    """``check_billing`` of a reservation of ``max_output_tokens`` that has billed ``before``."""
    if billed.output_tokens > max_output_tokens:
        raise InvalidUsage(
            f"{kind}: output_tokens {billed.output_tokens} is above the reservation's "
            f"max_output_tokens {max_output_tokens}"
        )
    for name in ("input_tokens", "output_tokens", "gpu_ms"):
        if getattr(billed, name) < getattr(before, name):
            raise InvalidUsage(
                f"{kind}: {name} {getattr(billed, name)} is below what was billed already "
                f"({getattr(before, name)}); amounts are cumulative"
            )


def check_retry(existing: Reservation, args: ReserveArgs) -> Reservation:
    """``existing`` (the reservation made under ``args``' request id) when ``args`` repeat its arguments.
    Raises ``IdempotencyConflict`` otherwise."""
    if ReserveArgs.of(existing).fingerprint() != args.fingerprint():
        raise IdempotencyConflict(
            f"request id {args.request_id!r} of tenant {args.tenant!r} was reserved with other arguments"
        )
    return existing


def reopens(existing: Reservation) -> bool:
    """Whether a retry re-admits ``existing`` (its arguments repeated, ``check_retry``): a reservation
    cancelled with nothing billed never ran (a request that ran bills its prompt at least), so it may be
    reserved again - charged again as ``reopened`` (``reserve(..., again=True)``: not counted as another
    request). Every other final reservation is returned as it is."""
    return existing.status == "cancelled" and existing.billed == Usage()


def reopened(existing: Reservation, limits: Limits, now_ms: float, price: Price) -> Reservation:
    """``existing`` (``reopens``) open again at ``now_ms``: same id and creation time, nothing billed, a new
    TTL (``limits``: its class's), the class's ``price`` now. Charged as ``reserve(..., again=True)`` charges
    it, with a ``reserve`` event that counts no request (the first one did)."""
    return replace(
        existing,
        status="open",
        billed=Usage(),
        overage_gpu_ms=0.0,
        expires_at_ms=now_ms + limits.reservation_ttl_s * 1000.0,
        final_ms=None,
        queued=False,
        price=price,
    )


def check_final_again(reservation: Reservation, billed: Usage, final: bool, kind: str) -> Reservation:
    """A settle / cancel / expire of a ``reservation`` final already: the same final call repeated (same
    kind, same amounts) returns it; anything else raises ``ReservationFinal``."""
    if final and STATUS_OF_KIND[kind] == reservation.status and reservation.billed == billed:
        return reservation
    raise ReservationFinal(f"reservation {reservation.id!r} is {reservation.status} already")


def claim(current: RunClaim | None, owner: str, lease_ms: float, now_ms: float) -> RunClaim:
    """The run claim after ``owner`` asks for it at ``now_ms``: taken (or renewed) for ``lease_ms`` when nobody
    holds it, ``owner`` holds it, or the holder's lease has lapsed; otherwise the holder's claim unchanged."""
    if current is None or current.owner == owner or current.until_ms <= now_ms:
        return RunClaim(owner, now_ms + lease_ms, now_ms)
    return RunClaim(current.owner, current.until_ms, now_ms)


def claim_on_reserve(
    reservation: Reservation, current: RunClaim | None, owner: str, lease_ms: float, now_ms: float
) -> RunClaim | None:
    """The run claim ``reserve(..., claim_owner=owner, claim_lease_ms=lease_ms)`` leaves on the reservation it
    returns, decided in the reserve's own transaction right after the reservation (made, re-opened or returned
    as it was): ``claim`` of ``current`` (the claim stored on it; None on one this call made or re-opened); None
    on a final reservation, where ``claim`` would raise ``ReservationFinal`` and nothing is written. A reserve
    that raises (a quota, ``IdempotencyConflict``) writes no claim either. A claim taken or renewed (``owner``
    holds it) is written with a heartbeat, as ``claim`` writes it."""
    if reservation.is_final:
        return None
    return claim(current, owner, lease_ms, now_ms)


def queue_full(reservation: Reservation, limits: Limits) -> QuotaExceeded:
    """The error of an ``enqueue`` over ``max_queued``."""
    return QuotaExceeded(reservation.tenant, "max_queued", QUEUE_RETRY_S, limits.max_queued, 0)


def settle(
    reservation: Reservation,
    books: Sequence[Book],
    run: RunUsage | None,
    billed: Usage,
    final: bool,
    now_ms: float,
    kind: str,
) -> tuple[Reservation, list[Account], RunUsage | None, Delta]:
    """Bill cumulative usage ``billed`` against an open reservation (``final``: close it), on every account it
    was charged to (``books``, as ``reserve`` took them): the new accounts in that order.

    ``kind`` is ``settle``, ``cancel`` or ``expire`` (the status a final call leaves).

    Raises:
        InvalidUsage: amounts negative, below what was billed before, or output above the reservation.
    """
    r = reservation
    assert not r.is_final
    check_amounts(billed.input_tokens, billed.output_tokens, billed.gpu_ms, kind)
    check_billing(r, billed, kind)
    before = r.billed
    old_in, old_out, old_gpu = _held(r, before, False)
    new_in, new_out, new_gpu = _held(r, billed, final)
    spend_change = r.price.spend_micros(new_in, new_out, new_gpu) - r.price.spend_micros(old_in, old_out, old_gpu)
    accounts = [
        _settled_account(refreshed(account, limits, now_ms), limits, r, (old_in - new_in, old_out - new_out))
        for account, limits in books
    ]
    for acc in accounts:
        acc.gpu_window_used_ms = _used_after(acc.gpu_window_used_ms, acc.gpu_window_start_ms, r, new_gpu - old_gpu)
        acc.gpu_total_used_ms = max(0.0, acc.gpu_total_used_ms + new_gpu - old_gpu)
        acc.spend_used_micros = _used_after(acc.spend_used_micros, acc.spend_period_start_ms, r, spend_change)
        if final:
            acc.concurrent = max(0, acc.concurrent - 1)
            if r.queued:
                acc.queued = max(0, acc.queued - 1)
    new_run = run
    if run is not None and r.run_id is not None:
        new_run = replace(run, tokens=max(0, run.tokens + (new_in + new_out) - (old_in + old_out)))
    overage = max(0.0, billed.gpu_ms - r.gpu_ms_estimate)
    status: Status = STATUS_OF_KIND[kind] if final else "open"
    updated = replace(
        r,
        billed=billed,
        overage_gpu_ms=overage,
        status=status,
        final_ms=now_ms if final else None,
        queued=r.queued and not final,
    )
    delta = Delta(
        kind=("settle_final" if kind == "settle" else kind) if final else "settle",
        billed=Usage(
            billed.input_tokens - before.input_tokens,
            billed.output_tokens - before.output_tokens,
            billed.gpu_ms - before.gpu_ms,
        ),
        overage_gpu_ms=overage - r.overage_gpu_ms,
        spend_micros=r.price.spend_micros(billed.input_tokens, billed.output_tokens, billed.gpu_ms)
        - r.price.spend_micros(before.input_tokens, before.output_tokens, before.gpu_ms),
    )
    return updated, accounts, new_run, delta


def _used_after(used: float, period_start_ms: float, r: Reservation, change: float) -> float:
    """What a GPU window or spend period (``used`` since ``period_start_ms``) holds once ``r``'s hold in it changes
    by ``change``. A reservation made before the period began keeps its hold and billing in the period it was
    made in: the current one is charged only what it bills above that hold, never given back a hold it never
    took. (One re-opened in this period after being made in an earlier one counts as the earlier one's: its hold
    stays booked here until the period ends, which refuses sooner but never overspends.)"""
    if r.created_ms < period_start_ms:
        return used + max(0.0, change)
    return max(0.0, used + change)


def _settled_account(acc: Account, limits: Limits, r: Reservation, returned: tuple[int, int]) -> Account:
    """``acc`` (refreshed) with the token buckets given back (or charged) ``returned`` (input, output): the
    difference between what is held for ``r`` now and before, capped at the burst."""
    for dimension, prefix, diff in (("input_tokens", "input", returned[0]), ("output_tokens", "output", returned[1])):
        level = getattr(acc, f"{prefix}_level")
        if level is not None and diff:
            setattr(acc, f"{prefix}_level", ratelimit.credit(level, diff, limits.burst(dimension) or 0.0))
    return acc


def enqueue(reservation: Reservation, books: Sequence[Book]) -> tuple[Reservation, list[Account]] | None:
    """The request behind an open reservation must wait for an upstream slot: take a queue place on every
    account it was charged to (``books``).

    Returns the updated reservation and accounts, or None when there is nothing to do (final, or holding a
    place already).

    Raises:
        QuotaExceeded: ``max_queued`` places are taken on one of the accounts (dimension ``max_queued``).
    """
    if reservation.is_final or reservation.queued:
        return None
    for account, limits in books:
        if limits.max_queued is not None and account.queued >= limits.max_queued:
            raise queue_full(reservation, limits)
    return replace(reservation, queued=True), [replace(account, queued=account.queued + 1) for account, _ in books]


def dequeue(reservation: Reservation, accounts: Sequence[Account]) -> tuple[Reservation, list[Account]] | None:
    """The queued request got an upstream slot: give its queue place back on every account it was charged to.
    None: it holds none (never queued, dequeued already, or final - a final settlement gives the place back)."""
    if reservation.is_final or not reservation.queued:
        return None
    return replace(reservation, queued=False), [replace(a, queued=max(0, a.queued - 1)) for a in accounts]
