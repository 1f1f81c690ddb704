"""What a tier does when the ledger cannot be reached: ``reject``, or a small, bounded local ``emergency`` budget.

Seed 003: "free sandboxes can reject new requests, and critical paid tenants can use small local emergency
quotas, but you must never fail-open indefinitely". ``ResilientLedger`` wraps a ``Ledger``:

- ``reject`` tiers: ``LedgerUnavailable`` goes to the caller (the gateway answers 503 with Retry-After).
- ``emergency`` tiers: a grant from this process's local budget per tenant, bounded in requests, tokens
  (prompt + max output) and time (grants only within ``seconds`` of the outage's first grant). Past any
  bound: ``LedgerUnavailable``. Each grant, and every settlement or cancel that could not reach the ledger,
  is written to a journal (JSON lines, appended and flushed before the call returns).
- ``recover()`` replays the journal into the ledger once it answers again: each grant is reserved under
  its original request id (idempotent, so a replay interrupted half-way can run again) and closed with
  the usage recorded; pending settlements are applied. The local budgets reset.
- A grant whose request id ran elsewhere as well (another process granted or ran it during the outage; it
  was final in the ledger already): both runs were delivered, so both are billed - the grant under its own
  reservation, request id ``duplicate_id`` (``<id>#dup-<grant>``). Exactly once across processes needs the
  ledger; an ``emergency`` tier trades it for availability while the ledger is down, not billing.
- A grant the ledger will not take (a quota now full; usage it refuses) is **parked**: moved from the
  journal to the parked file beside it (``<journal>.parked.jsonl``) with its usage and the reason, for
  the operator (``parked()``, ``/admin/reconcile``, ``fairgate ledger journal``). It never stays in the
  journal, where it would hold the liveness sweep's expiry (``expire_due``) for good.
- A grant still open in the journal a process starts with was its predecessor's (killed mid-request): it
  is cancelled with the usage last journalled, so no grant stays open, and holds expiry, for good.
- A process does not grant a request id it has seen final (or open) in the ledger: it remembers the last
  ``KNOWN_IDS_MAX`` reservations the ledger returned to it, and answers a retry of one of them from memory
  during an outage (a final one is not run again).

The budget is per process: with N gateway processes an outage grants at most N times the tier's budget,
still bounded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fairgate.ledger.base import IsRunning, Ledger, RequestPath
from fairgate.ledger.checks import check_consumed
from fairgate.ledger.model import (
    IdempotencyConflict,
    InvalidUsage,
    LedgerError,
    LedgerUnavailable,
    Reservation,
    ReservationFinal,
    ReservationNotFound,
    RunClaim,
    Usage,
)
from fairgate.ledger.rules import Account, ReserveArgs, check_billing, check_retry

log = logging.getLogger("fairgate.ledger")
EMERGENCY_PREFIX = "emg-"
# Late reservations per closed one: its call's final settlement and its journal's last record may each take one
# (the next when another billed less), so a few are enough.
LATE_RESERVATIONS_MAX = 4
KNOWN_IDS_MAX = 100_000  # reservations remembered per process (~200 bytes each: ~20 MB at most)


@dataclass
class _Budget:
    started_ms: float
    requests: int = 0
    tokens: int = 0


@dataclass
class RecoveryReport:
    """What ``recover`` replayed: grants reserved and closed, settlements applied, partial settlements a later
    one had already billed past (``settlements_superseded``: amounts are cumulative, nothing to apply),
    settlements whose reservation had closed with less billed, the rest billed under a reservation of its own
    (``settlements_late``: ``late_id``), and failures left."""

    grants_settled: int = 0
    settlements_applied: int = 0
    settlements_superseded: int = 0
    settlements_late: int = 0
    left: list[str] = field(default_factory=list)


class ResilientLedger(RequestPath):
    """The request path (``RequestPath``) of a ``Ledger``, applying each tier's ``on_ledger_unavailable``
    (see module docstring) when the ledger cannot be reached.

    ``RequestPath``, all of it: ``reserve`` (a grant in an outage), ``settle`` / ``cancel`` (journalled in an
    outage), ``enqueue`` / ``dequeue`` (skipped in an outage), ``get``, ``claim`` and ``heartbeat`` (an emergency
    grant answered here), ``account`` (``LedgerUnavailable`` in an outage). ``Coordination``: ``expire_due`` (the
    liveness sweep, held while the journal is not replayed). Its own: ``recover``, ``outstanding``,
    ``live_id``. ``Operator`` calls go to ``ledger`` (the wrapped ``Ledger``) directly.

    Args:
        ledger: the real ledger.
        journal: JSON-lines file of emergency grants and pending settlements (created if missing).
        clock: ms, monotonic within the process (default ``time.monotonic``).
    """

    def __init__(self, ledger: Ledger, journal: str | Path, clock: Callable[[], float] | None = None) -> None:
        self.ledger = ledger
        self.journal = Path(journal)
        self.journal.parent.mkdir(parents=True, exist_ok=True)
        self._clock = clock or (lambda: time.monotonic() * 1000.0)
        self._budgets: dict[str, _Budget] = {}
        self._recovering = asyncio.Lock()  # one replay at a time
        self._grants, _ = _fold(self._read_journal())  # each grant with its latest usage and status
        for grant in self._grants.values():
            if grant["status"] == "open":  # its process has ended (this one is new): its request is gone
                grant["status"] = "cancelled"
                self._append({"type": "grant_usage", "id": grant["id"], "usage": grant["usage"], "status": "cancelled"})
        self._known: OrderedDict[tuple[str, str], Reservation] = OrderedDict()  # (tenant, request id) -> last seen
        self.parked_path = self.journal.with_suffix(".parked.jsonl")
        # Request ids whose reserve failed as unavailable and was refused: the ledger may have committed it
        # after the caller stopped waiting (``clear_doubts``).
        # Each with the owner of the run claim its reserve asked for (None: none).
        self._doubts: dict[tuple[str, str], str | None] = {}

    def _remember(self, r: Reservation) -> Reservation:
        """Keep ``r`` (the ledger's latest answer about its request id), the oldest forgotten past the bound."""
        key = (r.tenant, r.request_id)
        self._known[key] = r
        self._known.move_to_end(key)
        if len(self._known) > KNOWN_IDS_MAX:
            self._known.popitem(last=False)
        return r

    # --- journal ----------------------------------------------------------------------------------
    def _append(self, record: dict[str, Any]) -> None:
        _append_record(self.journal, record)

    def _read_journal(self) -> list[dict[str, Any]]:
        return _read_records(self.journal)

    # --- API ----------------------------------------------------------------------------------------
    async def reserve_args(
        self, args: ReserveArgs, claim_owner: str | None = None, claim_lease_ms: float = 0.0
    ) -> Reservation:
        """``RequestPath.reserve``; when the ledger is down, the tenant's tier decides (module docstring). The run
        claim asked (``claim_owner``) is the ledger's, or an emergency grant's not yet in the ledger, answered
        here as ``claim`` answers it; a reservation answered from memory carries none (``Reservation.claim``).

        Raises:
            LedgerUnavailable: a ``reject`` tier, or an emergency budget exhausted or expired; and every
                error ``Ledger.reserve`` raises.
        """
        key = (args.tenant, args.request_id)
        try:
            reserved = self._remember(await self.ledger.reserve_args(args, claim_owner, claim_lease_ms))
        except LedgerUnavailable:
            known = self._known.get(key)
            if known is not None:  # seen in the ledger: not granted (nor run) again
                return replace(check_retry(known, args), balances=None, claim=None)  # those it came with are old
            granted = self._grant(args)
            if granted is None:
                self.doubt(*key, claim_owner)
                raise
            if claim_owner is None or granted.is_final or self.live_id(granted.id) is not None:
                return granted
            now_ms = self._clock()
            return replace(granted, claim=RunClaim(claim_owner, now_ms + claim_lease_ms, now_ms))
        self._doubts.pop(key, None)  # the caller has it now
        return reserved

    def _grant(self, args: ReserveArgs) -> Reservation | None:
        """A grant from the tenant's emergency budget (journalled before it is returned), the earlier grant of
        a retried request, or None: the tier rejects. Raises ``UnknownTenant``, ``LedgerUnavailable`` (the
        budget is spent or its window over)."""
        tenant = args.tenant
        limits = self.ledger.limits(tenant, args.model_class)  # UnknownTenant before any grant
        tier = self.ledger.quotas.tenant(tenant).tier
        if tier.on_ledger_unavailable != "emergency":
            return None
        for record in self._grants.values():
            if record["tenant"] == tenant and record["request_id"] == args.request_id:
                return check_retry(self._grant_reservation(record), args)  # a retry of a granted request
        now = self._clock()
        budget = self._budgets.setdefault(tenant, _Budget(started_ms=now))
        tokens = args.input_tokens + args.max_output_tokens
        if now - budget.started_ms > tier.emergency_seconds * 1000.0:
            raise LedgerUnavailable(
                f"ledger unavailable and tenant {tenant!r}'s emergency window of {tier.emergency_seconds:g} s is over"
            ) from None
        if budget.requests + 1 > tier.emergency_requests or budget.tokens + tokens > tier.emergency_tokens:
            raise LedgerUnavailable(f"ledger unavailable and tenant {tenant!r}'s emergency budget is spent") from None
        budget.requests += 1
        budget.tokens += tokens
        record = {
            "type": "grant",
            "id": f"{EMERGENCY_PREFIX}{uuid.uuid4().hex}",
            "tenant": tenant,
            "request_id": args.request_id,
            "input_tokens": args.input_tokens,
            "max_output_tokens": args.max_output_tokens,
            "gpu_ms_estimate": float(args.gpu_ms_estimate),
            "model_class": args.model_class,
            "run_id": args.run_id,
            "tool_round": args.tool_round,
            "at_ms": time.time() * 1000.0,
            "ttl_ms": limits.reservation_ttl_s * 1000.0,
            "usage": None,
            "status": "open",
        }
        self._append(record)
        self._grants[record["id"]] = record
        return self._grant_reservation(record)

    def _grant_reservation(self, record: dict[str, Any]) -> Reservation:
        usage = Usage(*record["usage"]) if record["usage"] else Usage()
        return Reservation(
            id=record["id"],
            tenant=record["tenant"],
            request_id=record["request_id"],
            model_class=record["model_class"],
            run_id=record["run_id"],
            tool_round=record["tool_round"],
            input_tokens=record["input_tokens"],
            max_output_tokens=record["max_output_tokens"],
            gpu_ms_estimate=record["gpu_ms_estimate"],
            status=record["status"],
            billed=usage,
            overage_gpu_ms=max(0.0, usage.gpu_ms - record["gpu_ms_estimate"]),
            created_ms=record["at_ms"],
            expires_at_ms=record["at_ms"] + record["ttl_ms"],
        )

    async def _close(self, reservation_id: str, usage: Usage, final: bool, kind: str) -> Reservation:
        grant = self._grants.get(reservation_id)
        if grant is not None:
            if grant["status"] != "open":
                raise ReservationFinal(f"emergency grant {reservation_id!r} is {grant['status']} already")
            # The ledger's own checks, before journalling: usage it would refuse at replay never enters.
            usage = check_consumed(usage, kind)
            check_billing(self._grant_reservation(grant), usage, kind)
            grant["usage"] = [usage.input_tokens, usage.output_tokens, usage.gpu_ms]
            if final:
                grant["status"] = "settled" if kind == "settle" else "cancelled"
            self._append(
                {"type": "grant_usage", "id": reservation_id, "usage": grant["usage"], "status": grant["status"]}
            )
            return self._grant_reservation(grant)
        try:
            try:
                if kind == "cancel":
                    return self._remember(await self.ledger.cancel(reservation_id, usage))
                return self._remember(
                    await self.ledger.settle(
                        reservation_id, usage.input_tokens, usage.output_tokens, usage.gpu_ms, final
                    )
                )
            except ReservationFinal:
                # A partial settlement is left to the call's final one (each would take a late reservation of its
                # own: an outside tester's stream used up LATE_RESERVATIONS_MAX within a second of a partition's end).
                if not final or await self._billed_past(reservation_id, usage):
                    raise
                return await self._closed_meanwhile(reservation_id, usage)
        except LedgerUnavailable:
            # Usage must not be lost: keep it for recover(). The caller learns the ledger is down.
            self._append(
                {
                    "type": "pending",
                    "id": reservation_id,
                    "kind": kind,
                    "final": final,
                    "usage": [usage.input_tokens, usage.output_tokens, usage.gpu_ms],
                }
            )
            raise

    async def _closed_meanwhile(self, reservation_id: str, usage: Usage) -> Reservation:
        """A settlement of a reservation another process closed with less billed (it expired while this process
        could not reach the ledger, or a retry elsewhere closed it): the rest is billed late (``_bill_late``), and
        the closed reservation returned. Raises ``LedgerUnavailable``, ``ReservationFinal`` (refused: logged)."""
        report = RecoveryReport()
        await self._bill_late(reservation_id, usage, report)
        if report.left:
            log.warning(
                json.dumps({"event": "late_billing_refused", "reservation": reservation_id, "left": report.left})
            )
            raise ReservationFinal(report.left[0])
        return await self.ledger.get(reservation_id)

    async def settle(
        self, reservation_id: str, input_tokens: int, output_tokens: int, gpu_ms: float, final: bool = False
    ) -> Reservation:
        """``RequestPath.settle``; usage of an emergency grant, or one the ledger cannot take now, is journalled."""
        return await self._close(reservation_id, Usage(input_tokens, output_tokens, gpu_ms), final, "settle")

    async def cancel(self, reservation_id: str, consumed: Usage) -> Reservation:
        """``RequestPath.cancel``; journalled like ``settle`` when the ledger cannot take it."""
        return await self._close(reservation_id, consumed, True, "cancel")

    async def enqueue(self, reservation_id: str) -> Reservation | None:
        """``RequestPath.enqueue``; an emergency grant takes no shared queue place (its local budget bounds
        it), nor does a request while the ledger cannot be reached (the process's own queue bound still
        holds): both return None.

        Raises:
            QuotaExceeded: ``max_queued``; and the other errors of ``Ledger.enqueue`` but ``LedgerUnavailable``.
        """
        return await self._queue_step(self.ledger.enqueue, reservation_id)

    async def dequeue(self, reservation_id: str) -> Reservation | None:
        """``RequestPath.dequeue``, best effort: if the ledger cannot take it now (None), the reservation's
        final settlement gives the place back instead (never lost); None for an emergency grant too."""
        return await self._queue_step(self.ledger.dequeue, reservation_id)

    async def _queue_step(
        self, step: Callable[[str], Awaitable[Reservation | None]], reservation_id: str
    ) -> Reservation | None:
        """``step`` (the ledger's enqueue or dequeue) for a reservation the ledger holds, if it answers."""
        if reservation_id in self._grants:
            return None
        try:
            return await step(reservation_id)
        except LedgerUnavailable:
            return None

    async def get(self, reservation_id: str) -> Reservation:
        """``RequestPath.get``: an emergency grant as this process knows it (whether the ledger answers or
        not), any other reservation from the ledger.

        Raises:
            ReservationNotFound, InvalidUsage, LedgerUnavailable (the ledger cannot be reached).
        """
        grant = self._grants.get(reservation_id)
        if grant is not None:
            return self._grant_reservation(grant)
        return await self.ledger.get(reservation_id)

    async def account(self, tenant: str, model_class: str = "default") -> Account:
        """``RequestPath.account``: the ledger's balances. No local stand-in: when the ledger cannot be
        reached this raises ``LedgerUnavailable`` (the gateway then leaves the remaining-quota headers out)."""
        return await self.ledger.account(tenant, model_class)

    async def heartbeat(self, reservation_id: str) -> None:
        """``RequestPath.heartbeat`` under the id the ledger knows (``live_id``): an emergency grant replayed
        while still running beats its ledger reservation; one not yet in the ledger has nothing to keep
        alive there (a no-op).

        Raises:
            ReservationNotFound, InvalidUsage, LedgerUnavailable (not journalled: a missed beat only matters
            if none lands within the reservation's TTL).
        """
        live = self.live_id(reservation_id) if isinstance(reservation_id, str) else reservation_id  # InvalidUsage
        if live is not None:
            await self.ledger.heartbeat(live)

    async def claim(self, reservation_id: str, owner: str, lease_ms: float) -> RunClaim:
        """``RequestPath.claim`` under the id the ledger knows (``live_id``). An emergency grant not yet in the
        ledger is this process's alone: its claim is ``owner``'s, unlapsed, answered here.

        Raises:
            as ``RequestPath.claim``; ``LedgerUnavailable`` is not journalled (the caller decides: a request
            not yet running is refused, a running one renews at the next sweep).
        """
        live = self.live_id(reservation_id) if isinstance(reservation_id, str) else reservation_id  # InvalidUsage
        if live is None:
            now_ms = self._clock()
            return RunClaim(owner, now_ms + lease_ms, now_ms)
        return await self.ledger.claim(live, owner, lease_ms)

    async def expire_due(self, is_running: IsRunning | None = None) -> list[Reservation]:
        """``Coordination.expire_due`` on the ledger, held (``[]``) while the journal holds records not yet
        replayed: usage not yet in the ledger would be lost to an expiry now. Raises ``LedgerUnavailable``."""
        if self.outstanding():
            return []
        return await self.ledger.expire_due(is_running)

    def doubt(self, tenant: str, request_id: str, claimed_by: str | None = None) -> None:
        """Put a request id in doubt: its reservation may be left open with nobody to run it (a claim that
        failed, a reserve that timed out); ``clear_doubts`` cancels it if nobody does. ``claimed_by``: the owner
        whose run claim the reserve asked for (a reserve that timed out may have taken it with the reservation)."""
        self._doubts[(tenant, request_id)] = claimed_by

    def doubtful(self) -> int:
        """Refused reserves the ledger may have committed after all (``clear_doubts``)."""
        return len(self._doubts)

    async def clear_doubts(self, owner: str, lease_ms: float) -> int:
        """Cancel, billing nothing, the reservations a refused reserve left behind: a reserve that timed out may
        still commit once the ledger answers, and its open reservation would hold a concurrency slot, unseen,
        for a TTL. For each request id in doubt, an open reservation with nothing billed whose run claim
        ``owner`` can take (nobody runs it: a retry would hold the claim) is cancelled. A request id whose reserve
        asked for the run claim (``doubt``'s ``claimed_by``) and whose reservation that claim still holds stays in
        doubt until it lapses: the reserve may have taken it, for a run that never started. Returns how many
        were cancelled.

        Raises:
            LedgerUnavailable: still down (the doubts are kept for the next call).
        """
        cancelled = 0
        for (tenant, request_id), claimed_by in sorted(self._doubts.items()):
            waiting = False
            for r in await self.ledger.reservations(tenant, "open"):
                if r.request_id != request_id or r.billed != Usage():
                    continue
                claim = await self.ledger.claim(r.id, owner, lease_ms)
                if claim.held_by(owner):
                    await self.ledger.cancel(r.id, Usage())
                    cancelled += 1
                waiting = waiting or (claimed_by is not None and claim.held_by(claimed_by))
            if not waiting:
                self._doubts.pop((tenant, request_id), None)
        return cancelled

    def outstanding(self) -> int:
        """Journal records not yet replayed into the ledger."""
        return len(self._read_journal())

    def live_id(self, reservation_id: str) -> str | None:
        """The ledger's id for ``reservation_id``: itself, or for an emergency grant replayed while still
        running, the reservation the replay made (None: a grant not yet in the ledger)."""
        if not reservation_id.startswith(EMERGENCY_PREFIX):
            return reservation_id
        grant = self._grants.get(reservation_id)
        return grant.get("ledger_id") if grant is not None else None

    async def recover(self) -> RecoveryReport:
        """Replay the journal into the ledger (see module docstring); rewrite it with what is left and what
        was appended meanwhile. One replay at a time.

        Raises:
            LedgerUnavailable: the ledger is still down (the journal is kept whole).
        """
        async with self._recovering:
            return await self._recover()

    async def _recover(self) -> RecoveryReport:
        report = RecoveryReport()
        records = self._read_journal()
        grants, pending = _fold(records)
        left = [grant for grant in grants.values() if await self._replay_grant(grant, report)]
        for record in _latest_per_reservation(pending):
            await self._replay_pending(record, report)
        # Records appended while the replay waited on the ledger (a grant finishing, a settlement that could
        # not reach it) are kept after what is left, for the next replay.
        # (The replay's own ``grant_ledger_id`` marks are not kept: a grant kept holds its ledger id itself.)
        appended = [r for r in self._read_journal()[len(records) :] if r["type"] != "grant_ledger_id"]
        tmp = self.journal.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in [*left, *appended]))
        tmp.replace(self.journal)
        self._grants, _ = _fold(appended, {g["id"]: g for g in left})
        self._budgets.clear()
        return report

    async def _replay_grant(self, grant: dict[str, Any], report: RecoveryReport) -> bool:
        """Reserve ``grant`` in the ledger under its request id and bill its usage; True: keep it in the
        journal (still running). One the ledger will not take is parked (module docstring). Raises
        ``LedgerUnavailable``."""
        args = ReserveArgs.of(self._grant_reservation(grant))
        try:
            r: Reservation | None = await self.ledger.reserve_args(args)
        except IdempotencyConflict:  # the id ran elsewhere with other arguments: this run is billed on its own
            r = None
        except LedgerUnavailable:
            raise
        except LedgerError as exc:
            return self._park(grant, f"the ledger refused its reservation: {exc}", report)
        if r is not None and r.is_final and grant.get("ledger_id") == r.id:  # an interrupted replay closed it
            report.grants_settled += 1
            return False
        if r is None or _ran_elsewhere(r, grant):
            r = await self._reserve_duplicate(grant, args, report)
            if r is None:
                return False
        try:
            return await self._bill_grant(grant, r, report)
        except ReservationFinal as exc:
            if r.request_id != grant["request_id"]:
                return self._park(grant, f"the ledger closed its reservation meanwhile: {exc}", report)
            # Another process replaying its own grant of this request id closed the reservation between this
            # reserve and this settlement: both runs were delivered, so this one is billed as a duplicate.
            r = await self._reserve_duplicate(grant, args, report)
            return False if r is None else await self._bill_grant(grant, r, report)

    async def _reserve_duplicate(
        self, grant: dict[str, Any], args: ReserveArgs, report: RecoveryReport
    ) -> Reservation | None:
        """The reservation ``grant`` is billed under when its request id ran elsewhere too (``duplicate_id``);
        None: the ledger refused it and the grant is parked. Raises ``LedgerUnavailable``."""
        try:
            return await self.ledger.reserve_args(replace(args, request_id=duplicate_id(grant)))
        except LedgerUnavailable:
            raise
        except LedgerError as exc:
            self._park(grant, f"request id {grant['request_id']!r} ran elsewhere too; {exc}", report)
            return None

    async def _bill_grant(self, grant: dict[str, Any], r: Reservation, report: RecoveryReport) -> bool:
        """Bill ``grant``'s usage to its reservation ``r``; True: keep it in the journal (still running). A
        usage the ledger refuses parks it. Raises ``LedgerUnavailable``, and ``ReservationFinal`` when ``r``
        was closed by someone else (the caller decides)."""
        usage = Usage(*grant["usage"]) if grant["usage"] else Usage(grant["input_tokens"], 0, 0.0)
        if grant.get("ledger_id") != r.id:  # journalled before it is closed: a replay again knows it as its own
            grant["ledger_id"] = r.id
            self._append({"type": "grant_ledger_id", "id": grant["id"], "ledger_id": r.id})
        try:
            if grant["status"] == "open":  # the gateway heartbeats it under its ledger id from now on
                await self.ledger.settle(r.id, usage.input_tokens, usage.output_tokens, usage.gpu_ms)
                return True  # still running: keep it, settle again at the next recover
            if grant["status"] == "cancelled":
                await self.ledger.cancel(r.id, usage)
            else:
                await self.ledger.settle(r.id, usage.input_tokens, usage.output_tokens, usage.gpu_ms, final=True)
        except (LedgerUnavailable, ReservationFinal):
            raise
        except LedgerError as exc:
            # The reservation now in the ledger expires at its TTL, billing what was settled.
            return self._park(grant, f"the ledger refused its usage: {exc}", report)
        report.grants_settled += 1
        return False

    def _park(self, grant: dict[str, Any], reason: str, report: RecoveryReport) -> bool:
        """Move ``grant`` to the parked file with ``reason`` (appended and flushed); False: not kept."""
        _append_record(
            self.parked_path, {**grant, "type": "parked", "reason": reason, "parked_at_ms": time.time() * 1000.0}
        )
        report.left.append(f"grant {grant['id']} ({grant['tenant']}/{grant['request_id']}) parked: {reason}")
        return False

    def parked(self) -> list[dict[str, Any]]:
        """The grants parked for the operator, oldest first (``read_parked``)."""
        return read_parked(self.parked_path)

    async def _replay_pending(self, record: dict[str, Any], report: RecoveryReport) -> None:
        """Apply a settlement the ledger could not take when it was made. Raises ``LedgerUnavailable``."""
        usage = Usage(*record["usage"])
        try:
            if record["kind"] == "cancel":
                await self.ledger.cancel(record["id"], usage)
            else:
                await self.ledger.settle(
                    record["id"], usage.input_tokens, usage.output_tokens, usage.gpu_ms, record["final"]
                )
            report.settlements_applied += 1
        except LedgerUnavailable:
            raise
        except ReservationFinal:
            if await self._billed_past(record["id"], usage):
                report.settlements_applied += 1  # applied before (a replay of the replay), or billed past since
            else:  # closed meanwhile with less billed (expired, or by a retry elsewhere)
                await self._bill_late(record["id"], usage, report)
        except InvalidUsage as exc:
            if record["final"] or not await self._billed_past(record["id"], usage):
                report.left.append(f"settlement of {record['id']}: {exc}")
            else:  # a partial settlement that missed the ledger, then a later one of the same call reached it
                report.settlements_superseded += 1
        except LedgerError as exc:
            report.left.append(f"settlement of {record['id']}: {exc}")

    async def _bill_late(self, reservation_id: str, usage: Usage, report: RecoveryReport) -> None:
        """Bill what cumulative ``usage`` holds beyond what the closed reservation ``reservation_id`` billed, as
        a reservation of its own, settled at once (``late_id``, reserved with the closed one's arguments, so that
        a replay again finds it and bills nothing twice; what it billed is taken off, and a later, larger
        settlement of the same call bills its rest under the next one). A process cut off from the ledger longer
        than a TTL finds its reservations expired by the others, billing only what had reached the ledger. What
        the ledger refuses (a quota now spent) is reported as left and parked for the operator (``_park_late``).
        Raises ``LedgerUnavailable``."""
        closed = await self.ledger.get(reservation_id)
        rest, args = _difference(usage, closed.billed), ReserveArgs.of(closed)
        k = 1
        try:
            for k in range(1, LATE_RESERVATIONS_MAX + 1):
                late = await self.ledger.reserve_args(replace(args, request_id=late_id(closed, k)))
                if not late.is_final:
                    try:
                        await self.ledger.settle(late.id, *_amounts(rest), final=True)
                        report.settlements_late += 1
                        return
                    except ReservationFinal:  # another settlement's rest got there first: take it off
                        late = await self.ledger.get(late.id)
                rest = _difference(rest, late.billed)
                if rest == Usage():
                    report.settlements_applied += 1  # billed late before
                    return
            raise ReservationFinal(f"{LATE_RESERVATIONS_MAX} late reservations billed already")
        except LedgerUnavailable:
            raise
        except LedgerError as exc:
            report.left.append(f"settlement of {reservation_id}: closed with less billed; {rest} not billed: {exc}")
            self._park_late(closed, late_id(closed, k), rest, f"late billing of reservation {closed.id} refused: {exc}")

    def _park_late(self, closed: Reservation, request_id: str, rest: Usage, reason: str) -> None:
        """Park usage the ledger would not bill late (``_bill_late``) as a grant the ledger would not take: the
        operator sees it (``parked``, ``/admin/reconcile``, ``fairgate ledger journal``, exit 1) where a log line
        alone was missed. Once per late id and usage: a replay refused again adds nothing."""
        amounts = list(_amounts(rest))
        if any(r.get("id") == request_id and r.get("usage") == amounts for r in self.parked()):
            return
        record = {
            "type": "parked",
            "id": request_id,
            "tenant": closed.tenant,
            "request_id": request_id,
            "reservation": closed.id,
            "usage": amounts,
            "status": "late",
            "reason": reason,
            "parked_at_ms": time.time() * 1000.0,
        }
        _append_record(self.parked_path, record)

    async def _billed_past(self, reservation_id: str, usage: Usage) -> bool:
        """Whether the ledger has billed the reservation ``reservation_id`` (open or closed) at least ``usage`` in
        every amount. Raises ``LedgerUnavailable``."""
        try:
            billed = (await self.ledger.get(reservation_id)).billed
        except (ReservationNotFound, InvalidUsage):
            return False
        return _difference(usage, billed) == Usage()


def _fold(
    records: list[dict[str, Any]], grants: dict[str, dict[str, Any]] | None = None
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Journal records folded onto ``grants`` (by id): each grant with its latest usage and status, and the
    pending settlements in order. Usage of a grant not in ``grants`` (replayed and closed) is dropped."""
    grants = {} if grants is None else grants
    pending: list[dict[str, Any]] = []
    for record in records:
        if record["type"] == "grant":
            grants[record["id"]] = dict(record)
        elif record["type"] == "grant_usage":
            if record["id"] in grants:
                grants[record["id"]].update(usage=record["usage"], status=record["status"])
        elif record["type"] == "grant_ledger_id":
            if record["id"] in grants:
                grants[record["id"]]["ledger_id"] = record["ledger_id"]
        else:
            pending.append(record)
    return grants, pending


def read_parked(path: Path) -> list[dict[str, Any]]:
    """The parked grants in the file at ``path`` (none if it does not exist): each grant's journal record
    (tenant, request id, what was reserved, ``usage`` [input, output, GPU ms] or None, ``status``) with
    ``reason`` and ``parked_at_ms``. Raises ``ValueError`` naming the line of a record that is not JSON."""
    return _read_records(path)


def read_journal(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """What the journal at ``path`` holds, not yet replayed: the grants (each with its latest usage and
    status) and the pending settlements. Raises ``ValueError`` naming the line of a bad record."""
    grants, pending = _fold(_read_records(path))
    return list(grants.values()), pending


def _append_record(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` to the JSON-lines file at ``path``, flushed before this returns."""
    with path.open("a") as handle:
        handle.write(json.dumps(record) + "\n")
        handle.flush()


def _read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not a JSON record ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("type"), str):
            raise ValueError(f"{path}:{number}: not a journal record (an object with a type)")
        records.append(record)
    return records


def late_id(closed: Reservation, k: int = 1) -> str:
    """The request id the rest of a settlement is billed under when its reservation closed with less billed, the
    ``k``-th such: ``<request id>#late-<reservation>`` (``#late<k>-`` after the first), within the 200
    characters of an id."""
    suffix = f"#late{'' if k == 1 else k}-{closed.id[-12:]}"
    return f"{closed.request_id[: 200 - len(suffix)]}{suffix}"


_LATE_ID = re.compile(r"(.*)#late(?:[2-9][0-9]*)?-[^#]{1,12}")


def late_base(request_id: str) -> str:
    """The request id whose closed reservation a late one bills the rest of (``late_id``); any other id as it is."""
    match = _LATE_ID.fullmatch(request_id)
    return match.group(1) if match else request_id


def _latest_per_reservation(pending: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The journalled settlements to replay: each reservation's last (amounts are cumulative, and a call's final
    settlement is its last), in the order of those."""
    latest = {record["id"]: record for record in pending}
    return [record for record in pending if latest[record["id"]] is record]


def _amounts(usage: Usage) -> tuple[int, int, float]:
    return usage.input_tokens, usage.output_tokens, usage.gpu_ms


def _difference(usage: Usage, billed: Usage) -> Usage:
    """What cumulative ``usage`` holds beyond ``billed``, amount by amount (never negative)."""
    return Usage(
        max(0, usage.input_tokens - billed.input_tokens),
        max(0, usage.output_tokens - billed.output_tokens),
        max(0.0, usage.gpu_ms - billed.gpu_ms),
    )


def duplicate_id(grant: dict[str, Any]) -> str:
    """The request id a grant is billed under when its own id ran elsewhere as well (on another process
    during the outage, or before it): ``<request id>#dup-<grant>``, within the 200 characters of an id."""
    suffix = f"#dup-{grant['id'][len(EMERGENCY_PREFIX) :][:12]}"
    return f"{grant['request_id'][: 200 - len(suffix)]}{suffix}"


def _ran_elsewhere(r: Reservation, grant: dict[str, Any]) -> bool:
    """The ledger's reservation of the grant's request id is another run's: closed, or holding usage this
    journal did not settle into it."""
    if grant.get("ledger_id") == r.id:
        return False
    return r.is_final or r.billed != Usage()
