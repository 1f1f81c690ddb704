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

The budget is per process: with N gateway processes an outage grants at most N times the tier's budget,
still bounded.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fairgate.ledger.base import IsRunning, Ledger, RequestPath
from fairgate.ledger.checks import check_consumed
from fairgate.ledger.model import LedgerError, LedgerUnavailable, Reservation, ReservationFinal, RunClaim, Usage
from fairgate.ledger.rules import Account, ReserveArgs, check_billing, check_retry

EMERGENCY_PREFIX = "emg-"


@dataclass
class _Budget:
    started_ms: float
    requests: int = 0
    tokens: int = 0


@dataclass
class RecoveryReport:
    """What ``recover`` replayed: grants reserved and closed, settlements applied, and failures left."""

    grants_settled: int = 0
    settlements_applied: int = 0
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

    # --- journal ----------------------------------------------------------------------------------
    def _append(self, record: dict[str, Any]) -> None:
        with self.journal.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()

    def _read_journal(self) -> list[dict[str, Any]]:
        if not self.journal.exists():
            return []
        return [json.loads(line) for line in self.journal.read_text().splitlines() if line.strip()]

    # --- API ----------------------------------------------------------------------------------------
    async def reserve_args(self, args: ReserveArgs) -> Reservation:
        """``RequestPath.reserve``; when the ledger is down, the tenant's tier decides (module docstring).

        Raises:
            LedgerUnavailable: a ``reject`` tier, or an emergency budget exhausted or expired; and every
                error ``Ledger.reserve`` raises.
        """
        try:
            return await self.ledger.reserve_args(args)
        except LedgerUnavailable:
            granted = self._grant(args)
            if granted is None:
                raise
            return granted

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
            if kind == "cancel":
                return await self.ledger.cancel(reservation_id, usage)
            return await self.ledger.settle(
                reservation_id, usage.input_tokens, usage.output_tokens, usage.gpu_ms, final
            )
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
        for record in pending:
            await self._replay_pending(record, report)
        # Records appended while the replay waited on the ledger (a grant finishing, a settlement that could
        # not reach it) are kept after what is left, for the next replay.
        appended = self._read_journal()[len(records) :]
        tmp = self.journal.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in [*left, *appended]))
        tmp.replace(self.journal)
        self._grants, _ = _fold(appended, {g["id"]: g for g in left})
        self._budgets.clear()
        return report

    async def _replay_grant(self, grant: dict[str, Any], report: RecoveryReport) -> bool:
        """Reserve ``grant`` in the ledger under its request id and bill its usage; True: keep it in the
        journal (still running, or refused by the ledger). Raises ``LedgerUnavailable``."""
        try:
            r = await self.ledger.reserve(
                grant["tenant"],
                grant["request_id"],
                grant["input_tokens"],
                grant["max_output_tokens"],
                grant["gpu_ms_estimate"],
                grant["model_class"],
                grant["run_id"],
                grant["tool_round"],
            )
        except LedgerUnavailable:
            raise
        except LedgerError as exc:
            # Over quota now that it is counted: the grant was still given; booking it as usage anyway
            # would break the ledger's invariants, so it is reported for the operator.
            report.left.append(f"grant {grant['id']} ({grant['tenant']}/{grant['request_id']}): {exc}")
            return True
        usage = Usage(*grant["usage"]) if grant["usage"] else Usage(grant["input_tokens"], 0, 0.0)
        try:
            if not r.is_final:
                if grant["status"] == "open":
                    await self.ledger.settle(r.id, usage.input_tokens, usage.output_tokens, usage.gpu_ms)
                    grant["ledger_id"] = r.id  # the gateway heartbeats it under this id from now on
                    return True  # still running: keep it, settle again at the next recover
                if grant["status"] == "cancelled":
                    await self.ledger.cancel(r.id, usage)
                else:
                    await self.ledger.settle(r.id, usage.input_tokens, usage.output_tokens, usage.gpu_ms, final=True)
        except LedgerUnavailable:
            raise
        except LedgerError as exc:
            # Usage the ledger refuses (a journal written before grants were checked, or edited): reported,
            # not kept - kept, it would hold the sweep (``expire_due``) for good; the reservation now in the
            # ledger expires at its TTL, billing what was settled.
            report.left.append(f"usage of grant {grant['id']} ({grant['tenant']}/{grant['request_id']}): {exc}")
            return False
        report.grants_settled += 1
        return False

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
            report.settlements_applied += 1  # applied before (a replay of the replay)
        except LedgerError as exc:
            report.left.append(f"settlement of {record['id']}: {exc}")


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
        else:
            pending.append(record)
    return grants, pending
