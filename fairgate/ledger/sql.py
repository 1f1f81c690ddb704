"""The ledger on a SQL database: the rules of ``rules.py`` applied inside one transaction per call.

Dialects (``sqlite.py``, ``postgres.py``) supply the transaction, the tenant lock and the clock; the
statements here use ``:name`` placeholders (rewritten for psycopg).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from fairgate.ledger import rules
from fairgate.ledger.base import (
    STATUSES,
    ChargeTotals,
    Event,
    IsRunning,
    Ledger,
    check_consumed,
    check_name,
    check_reserve_args,
    check_window,
    new_reservation_id,
    tenant_tag,
    usage_from_events,
)
from fairgate.ledger.model import (
    IdempotencyConflict,
    InvalidUsage,
    Reservation,
    ReservationFinal,
    ReservationNotFound,
    SettlementFrozen,
    TenantUsage,
    Usage,
)

TABLES = """
CREATE TABLE IF NOT EXISTS fg_accounts (
  tenant TEXT NOT NULL, model_class TEXT NOT NULL,
  requests_level {real}, requests_updated_ms {real} NOT NULL,
  input_level {real}, input_updated_ms {real} NOT NULL,
  output_level {real}, output_updated_ms {real} NOT NULL,
  concurrent INTEGER NOT NULL,
  gpu_window_start_ms {real} NOT NULL, gpu_window_used_ms {real} NOT NULL, gpu_total_used_ms {real} NOT NULL,
  queued INTEGER NOT NULL DEFAULT 0,
  PRIMARY KEY (tenant, model_class));
CREATE TABLE IF NOT EXISTS fg_runs (
  tenant TEXT NOT NULL, run_id TEXT NOT NULL,
  model_calls INTEGER NOT NULL, tool_rounds INTEGER NOT NULL, tokens BIGINT NOT NULL,
  PRIMARY KEY (tenant, run_id));
CREATE TABLE IF NOT EXISTS fg_reservations (
  id TEXT PRIMARY KEY, tenant TEXT NOT NULL, request_id TEXT NOT NULL, model_class TEXT NOT NULL,
  run_id TEXT, tool_round INTEGER NOT NULL,
  input_tokens BIGINT NOT NULL, max_output_tokens BIGINT NOT NULL, gpu_ms_estimate {real} NOT NULL,
  status TEXT NOT NULL,
  billed_input_tokens BIGINT NOT NULL, billed_output_tokens BIGINT NOT NULL, billed_gpu_ms {real} NOT NULL,
  overage_gpu_ms {real} NOT NULL, created_ms {real} NOT NULL, expires_at_ms {real} NOT NULL, final_ms {real},
  queued INTEGER NOT NULL DEFAULT 0,
  UNIQUE (tenant, request_id));
CREATE INDEX IF NOT EXISTS fg_reservations_open ON fg_reservations (status, expires_at_ms);
CREATE TABLE IF NOT EXISTS fg_events (
  seq {serial}, tenant TEXT NOT NULL, reservation_id TEXT NOT NULL, kind TEXT NOT NULL,
  requests INTEGER NOT NULL, input_tokens BIGINT NOT NULL, output_tokens BIGINT NOT NULL,
  gpu_ms {real} NOT NULL, overage_gpu_ms {real} NOT NULL, at_ms {real} NOT NULL);
CREATE INDEX IF NOT EXISTS fg_events_tenant ON fg_events (tenant, at_ms);
CREATE TABLE IF NOT EXISTS fg_frozen (tenant TEXT PRIMARY KEY, reason TEXT NOT NULL, at_ms {real} NOT NULL);
CREATE TABLE IF NOT EXISTS fg_heartbeats (reservation_id TEXT PRIMARY KEY, beat_ms {real} NOT NULL);
CREATE TABLE IF NOT EXISTS fg_charges (
  scope TEXT NOT NULL, tenant TEXT NOT NULL,
  gpu_ms {real} NOT NULL, input_tokens BIGINT NOT NULL, output_tokens BIGINT NOT NULL,
  PRIMARY KEY (scope, tenant));
CREATE TABLE IF NOT EXISTS fg_occupancy (
  process TEXT NOT NULL, upstream TEXT NOT NULL, sequences {real} NOT NULL, prefill_share {real} NOT NULL,
  expires_at_ms {real} NOT NULL, PRIMARY KEY (process, upstream));
"""

_RESERVATION_COLUMNS = (
    "id, tenant, request_id, model_class, run_id, tool_round, input_tokens, max_output_tokens, "
    "gpu_ms_estimate, status, billed_input_tokens, billed_output_tokens, billed_gpu_ms, "
    "overage_gpu_ms, created_ms, expires_at_ms, final_ms, queued"
)
_ACCOUNT_FIELDS = tuple(asdict(rules.Account()).keys())
_RESERVATION_FIELDS = tuple(c.strip() for c in _RESERVATION_COLUMNS.split(","))
_INSERT_RESERVATION = (
    f"INSERT INTO fg_reservations ({_RESERVATION_COLUMNS}) VALUES ({', '.join(':' + c for c in _RESERVATION_FIELDS)})"
)
_UPDATE_RESERVATION = (
    "UPDATE fg_reservations SET status = :status, billed_input_tokens = :billed_input_tokens, "
    "billed_output_tokens = :billed_output_tokens, billed_gpu_ms = :billed_gpu_ms, "
    "overage_gpu_ms = :overage_gpu_ms, expires_at_ms = :expires_at_ms, final_ms = :final_ms, "
    "queued = :queued WHERE id = :id"
)
_INSERT_EVENT = (
    "INSERT INTO fg_events (tenant, reservation_id, kind, requests, input_tokens, output_tokens, "
    "gpu_ms, overage_gpu_ms, at_ms) VALUES (:tenant, :rid, :kind, :requests, :input_tokens, "
    ":output_tokens, :gpu_ms, :overage_gpu_ms, :at_ms)"
)
_SAVE_RUN = (
    "INSERT INTO fg_runs (tenant, run_id, model_calls, tool_rounds, tokens) VALUES (:tenant, :run_id, "
    ":model_calls, :tool_rounds, :tokens) ON CONFLICT (tenant, run_id) DO UPDATE SET "
    "model_calls = excluded.model_calls, tool_rounds = excluded.tool_rounds, tokens = excluded.tokens"
)
# One read for a settle/cancel/expire: the reservation, whether its tenant is frozen, its account and run.
_LOAD_FOR_CLOSE = (
    "SELECT "
    + ", ".join(f"r.{c}" for c in _RESERVATION_FIELDS)
    + ", f.tenant, a.tenant, "
    + ", ".join(f"a.{c}" for c in _ACCOUNT_FIELDS)
    + ", u.model_calls, u.tool_rounds, u.tokens FROM fg_reservations r"
    " LEFT JOIN fg_frozen f ON f.tenant = r.tenant"
    " LEFT JOIN fg_accounts a ON a.tenant = r.tenant AND a.model_class = r.model_class"
    " LEFT JOIN fg_runs u ON u.tenant = r.tenant AND u.run_id = r.run_id WHERE r.id = :id"
)
_SAVE_ACCOUNT = (
    f"INSERT INTO fg_accounts (tenant, model_class, {', '.join(_ACCOUNT_FIELDS)}) VALUES (:tenant, "
    f":model_class, {', '.join(':' + f for f in _ACCOUNT_FIELDS)}) ON CONFLICT (tenant, model_class) "
    f"DO UPDATE SET {', '.join(f'{f} = excluded.{f}' for f in _ACCOUNT_FIELDS)}"
)


class Tx(Protocol):
    """One open transaction."""

    async def fetchone(self, sql: str, params: dict[str, Any] | None = None) -> tuple[Any, ...] | None: ...
    async def fetchall(self, sql: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]: ...
    async def execute(self, sql: str, params: dict[str, Any] | None = None) -> None: ...
    async def batch(self, statements: list[tuple[str, dict[str, Any]]]) -> list[list[tuple[Any, ...]]]:
        """Run ``statements`` in order, in one round trip where the driver can; every statement's rows."""
        ...


def _tag_of(reservation_id: object) -> str:
    """The tenant tag a reservation id starts with. Raises ``ReservationNotFound`` for a malformed id."""
    if not isinstance(reservation_id, str) or not reservation_id:
        raise InvalidUsage(f"reservation_id must be a non-empty string, got {reservation_id!r}")
    tag = reservation_id.split("-", 1)[0]
    if len(tag) != 16 or any(c not in "0123456789abcdef" for c in tag):
        raise ReservationNotFound(f"no reservation {reservation_id!r}")
    return tag


def _reservation(row: tuple[Any, ...]) -> Reservation:
    (
        rid,
        tenant,
        request_id,
        model_class,
        run_id,
        tool_round,
        input_tokens,
        max_output_tokens,
        estimate,
        status,
        billed_in,
        billed_out,
        billed_gpu,
        overage,
        created,
        expires,
        final,
        queued,
    ) = row
    return Reservation(
        id=rid,
        tenant=tenant,
        request_id=request_id,
        model_class=model_class,
        run_id=run_id,
        tool_round=bool(tool_round),
        input_tokens=int(input_tokens),
        max_output_tokens=int(max_output_tokens),
        gpu_ms_estimate=float(estimate),
        status=status,
        billed=Usage(int(billed_in), int(billed_out), float(billed_gpu)),
        overage_gpu_ms=float(overage),
        created_ms=float(created),
        expires_at_ms=float(expires),
        final_ms=None if final is None else float(final),
        queued=bool(queued),
    )


def _reservation_params(r: Reservation) -> dict[str, Any]:
    return {
        "id": r.id,
        "tenant": r.tenant,
        "request_id": r.request_id,
        "model_class": r.model_class,
        "run_id": r.run_id,
        "tool_round": int(r.tool_round),
        "input_tokens": r.input_tokens,
        "max_output_tokens": r.max_output_tokens,
        "gpu_ms_estimate": r.gpu_ms_estimate,
        "status": r.status,
        "billed_input_tokens": r.billed.input_tokens,
        "billed_output_tokens": r.billed.output_tokens,
        "billed_gpu_ms": r.billed.gpu_ms,
        "overage_gpu_ms": r.overage_gpu_ms,
        "created_ms": r.created_ms,
        "expires_at_ms": r.expires_at_ms,
        "final_ms": r.final_ms,
        "queued": int(r.queued),
    }


@dataclass(frozen=True)
class _Loaded:
    """What ``SqlLedger._load_for_update`` read."""

    reservation: Reservation
    frozen: bool
    account: rules.Account
    run_values: tuple[Any, ...]  # the run's counters (all None when the reservation has no run)
    now_ms: float | None  # the backend's clock, if it has one in SQL


class SqlLedger(Ledger):
    """``Ledger`` over SQL; subclasses provide ``_transaction``, ``_lock_tenant`` and ``_now_ms``."""

    @abstractmethod
    def _transaction(self) -> AbstractAsyncContextManager[Tx]:
        """A write transaction (committed on success, rolled back on error)."""

    @abstractmethod
    async def _lock_tenant(self, tx: Tx, tenant: str) -> None:
        """Serialise this transaction with every other one on ``tenant``."""

    @abstractmethod
    async def _now_ms(self, tx: Tx) -> float:
        """The ledger clock, ms since the epoch."""

    def _lock_statement(self, tag: str) -> tuple[str, dict[str, Any]] | None:
        """A statement that takes the tenant lock for tenant tag ``tag`` (None: the transaction is enough)."""
        return None

    def _now_statement(self) -> tuple[str, dict[str, Any]] | None:
        """A statement returning the clock (ms) as its one value (None: ``_now_ms`` needs no query)."""
        return None

    # --- state ---------------------------------------------------------------------------------
    async def _account(self, tx: Tx, tenant: str, model_class: str) -> rules.Account:
        row = await tx.fetchone(
            f"SELECT {', '.join(_ACCOUNT_FIELDS)} FROM fg_accounts "
            "WHERE tenant = :tenant AND model_class = :model_class",
            {"tenant": tenant, "model_class": model_class},
        )
        return rules.Account() if row is None else rules.Account(*row)

    async def _save_account(self, tx: Tx, tenant: str, model_class: str, account: rules.Account) -> None:
        values = {name: getattr(account, name) for name in _ACCOUNT_FIELDS}
        await tx.execute(_SAVE_ACCOUNT, {"tenant": tenant, "model_class": model_class, **values})

    async def _run(self, tx: Tx, tenant: str, run_id: str | None) -> rules.RunUsage | None:
        if run_id is None:
            return None
        row = await tx.fetchone(
            "SELECT model_calls, tool_rounds, tokens FROM fg_runs WHERE tenant = :tenant AND run_id = :run_id",
            {"tenant": tenant, "run_id": run_id},
        )
        return rules.RunUsage(*row) if row else rules.RunUsage()

    async def _save_run(self, tx: Tx, tenant: str, run_id: str | None, run: rules.RunUsage | None) -> None:
        if run_id is None or run is None:
            return
        await tx.execute(
            "INSERT INTO fg_runs (tenant, run_id, model_calls, tool_rounds, tokens) VALUES (:tenant, "
            ":run_id, :model_calls, :tool_rounds, :tokens) ON CONFLICT (tenant, run_id) DO UPDATE SET "
            "model_calls = excluded.model_calls, tool_rounds = excluded.tool_rounds, "
            "tokens = excluded.tokens",
            {"tenant": tenant, "run_id": run_id, **asdict(run)},
        )

    @staticmethod
    def _account_write(tenant: str, model_class: str, account: rules.Account) -> tuple[str, dict[str, Any]]:
        values = {name: getattr(account, name) for name in _ACCOUNT_FIELDS}
        return _SAVE_ACCOUNT, {"tenant": tenant, "model_class": model_class, **values}

    @staticmethod
    def _run_write(tenant: str, run_id: str, run: rules.RunUsage) -> tuple[str, dict[str, Any]]:
        return _SAVE_RUN, {
            "tenant": tenant,
            "run_id": run_id,
            "model_calls": run.model_calls,
            "tool_rounds": run.tool_rounds,
            "tokens": run.tokens,
        }

    @staticmethod
    def _event_write(r: Reservation, delta: rules.Delta, now_ms: float) -> tuple[str, dict[str, Any]]:
        return _INSERT_EVENT, {
            "tenant": r.tenant,
            "rid": r.id,
            "kind": delta.kind,
            "requests": delta.requests,
            "input_tokens": delta.input_tokens,
            "output_tokens": delta.output_tokens,
            "gpu_ms": delta.gpu_ms,
            "overage_gpu_ms": delta.overage_gpu_ms,
            "at_ms": now_ms,
        }

    async def _event(self, tx: Tx, r: Reservation, delta: rules.Delta, now_ms: float) -> None:
        await tx.execute(
            "INSERT INTO fg_events (tenant, reservation_id, kind, requests, input_tokens, output_tokens, "
            "gpu_ms, overage_gpu_ms, at_ms) VALUES (:tenant, :rid, :kind, :requests, :input_tokens, "
            ":output_tokens, :gpu_ms, :overage_gpu_ms, :at_ms)",
            {
                "tenant": r.tenant,
                "rid": r.id,
                "kind": delta.kind,
                "requests": delta.requests,
                "input_tokens": delta.input_tokens,
                "output_tokens": delta.output_tokens,
                "gpu_ms": delta.gpu_ms,
                "overage_gpu_ms": delta.overage_gpu_ms,
                "at_ms": now_ms,
            },
        )

    async def _load(self, tx: Tx, reservation_id: str, lock: bool) -> Reservation:
        if not isinstance(reservation_id, str) or not reservation_id:
            raise InvalidUsage(f"reservation_id must be a non-empty string, got {reservation_id!r}")
        row = await tx.fetchone(
            f"SELECT {_RESERVATION_COLUMNS} FROM fg_reservations WHERE id = :id", {"id": reservation_id}
        )
        if row is None:
            raise ReservationNotFound(f"no reservation {reservation_id!r}")
        r = _reservation(row)
        if lock:
            await self._lock_tenant(tx, r.tenant)
            row = await tx.fetchone(
                f"SELECT {_RESERVATION_COLUMNS} FROM fg_reservations WHERE id = :id", {"id": reservation_id}
            )
            assert row is not None
            r = _reservation(row)
        return r

    async def _update_reservation(self, tx: Tx, r: Reservation) -> None:
        await tx.execute(
            "UPDATE fg_reservations SET status = :status, billed_input_tokens = :billed_input_tokens, "
            "billed_output_tokens = :billed_output_tokens, billed_gpu_ms = :billed_gpu_ms, "
            "overage_gpu_ms = :overage_gpu_ms, expires_at_ms = :expires_at_ms, final_ms = :final_ms "
            "WHERE id = :id",
            _reservation_params(r),
        )

    # --- API ------------------------------------------------------------------------------------
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
        check_reserve_args(tenant, request_id, model_class, run_id, tool_round)
        limits = self.limits(tenant, model_class)
        args = rules.ReserveArgs(
            tenant, request_id, input_tokens, max_output_tokens, gpu_ms_estimate, model_class, run_id, bool(tool_round)
        )
        rules.check_amounts(input_tokens, max_output_tokens, gpu_ms_estimate, "reserve")
        lock, clock = self._lock_statement(tenant_tag(tenant)), self._now_statement()
        reads: list[tuple[str, dict[str, Any]]] = [s for s in (lock,) if s is not None]
        reads.append(
            (
                f"SELECT {_RESERVATION_COLUMNS} FROM fg_reservations WHERE tenant = :tenant AND "
                "request_id = :request_id",
                {"tenant": tenant, "request_id": request_id},
            )
        )
        reads.append(
            (
                f"SELECT {', '.join(_ACCOUNT_FIELDS)} FROM fg_accounts WHERE tenant = :tenant AND "
                "model_class = :model_class",
                {"tenant": tenant, "model_class": model_class},
            )
        )
        if run_id is not None:
            reads.append(
                (
                    "SELECT model_calls, tool_rounds, tokens FROM fg_runs WHERE tenant = :tenant AND run_id = :run_id",
                    {"tenant": tenant, "run_id": run_id},
                )
            )
        if clock is not None:
            reads.append(clock)
        async with self._transaction() as tx:
            rows = await tx.batch(reads)
            rows = rows[1:] if lock is not None else rows
            existing_rows, account_rows = rows[0], rows[1]
            run_rows = rows[2] if run_id is not None else []
            if existing_rows:
                existing = _reservation(existing_rows[0])
                if (
                    rules.ReserveArgs(
                        tenant,
                        request_id,
                        existing.input_tokens,
                        existing.max_output_tokens,
                        existing.gpu_ms_estimate,
                        existing.model_class,
                        existing.run_id,
                        existing.tool_round,
                    ).fingerprint()
                    != args.fingerprint()
                ):
                    raise IdempotencyConflict(
                        f"request id {request_id!r} of tenant {tenant!r} was reserved with other arguments"
                    )
                return existing
            now_ms = float(rows[-1][0][0]) if clock is not None else await self._now_ms(tx)
            account = rules.Account(*account_rows[0]) if account_rows else rules.Account()
            run = None if run_id is None else (rules.RunUsage(*run_rows[0]) if run_rows else rules.RunUsage())
            account, run = rules.reserve(account, run, limits, args, now_ms)
            r = Reservation(
                id=new_reservation_id(tenant),
                tenant=tenant,
                request_id=request_id,
                model_class=model_class,
                run_id=run_id,
                tool_round=bool(tool_round),
                input_tokens=input_tokens,
                max_output_tokens=max_output_tokens,
                gpu_ms_estimate=float(gpu_ms_estimate),
                status="open",
                billed=Usage(),
                overage_gpu_ms=0.0,
                created_ms=now_ms,
                expires_at_ms=now_ms + limits.reservation_ttl_s * 1000.0,
            )
            writes = [
                (_INSERT_RESERVATION, _reservation_params(r)),
                self._account_write(tenant, model_class, account),
                self._event_write(r, rules.Delta("reserve", requests=1), now_ms),
            ]
            if run_id is not None and run is not None:
                writes.append(self._run_write(tenant, run_id, run))
            await tx.batch(writes)
            return r

    async def _load_for_update(self, tx: Tx, reservation_id: str, with_clock: bool) -> _Loaded:
        """One round trip for a call on one reservation: the tenant's lock (if the backend takes one), the
        reservation with its tenant's frozen flag, account and run (``_LOAD_FOR_CLOSE``), and the clock.
        Raises ``ReservationNotFound``."""
        lock = self._lock_statement(_tag_of(reservation_id))
        clock = self._now_statement() if with_clock else None
        reads = [s for s in (lock, (_LOAD_FOR_CLOSE, {"id": reservation_id}), clock) if s is not None]
        rows = await tx.batch(reads)
        rows = rows[1:] if lock is not None else rows
        if not rows[0]:
            raise ReservationNotFound(f"no reservation {reservation_id!r}")
        row = rows[0][0]
        n, m = len(_RESERVATION_FIELDS), len(_ACCOUNT_FIELDS)
        account = rules.Account(*row[n + 2 : n + 2 + m]) if row[n + 1] is not None else rules.Account()
        now_ms = float(rows[1][0][0]) if clock is not None else None
        return _Loaded(_reservation(row[:n]), bool(row[n]), account, row[n + 2 + m :], now_ms)

    async def _close(
        self, reservation_id: str, billed: Usage, final: bool, kind: str, check_frozen: bool = True
    ) -> Reservation:
        async with self._transaction() as tx:
            loaded = await self._load_for_update(tx, reservation_id, with_clock=True)
            r, frozen, account, run_values = loaded.reservation, loaded.frozen, loaded.account, loaded.run_values
            if r.is_final:
                if (
                    final
                    and kind == {"settled": "settle", "cancelled": "cancel", "expired": "expire"}[r.status]
                    and r.billed == billed
                ):
                    return r  # the same final call, repeated
                raise ReservationFinal(f"reservation {reservation_id!r} is {r.status} already")
            if check_frozen and frozen:
                raise SettlementFrozen(f"automatic settlement is frozen for tenant {r.tenant!r}")
            if r.billed == billed and not final:
                return r  # a repeated partial settlement: nothing new
            now_ms = loaded.now_ms if loaded.now_ms is not None else await self._now_ms(tx)
            limits = self.limits(r.tenant, r.model_class)
            run = None
            if r.run_id is not None:
                run = rules.RunUsage(*run_values) if run_values[0] is not None else rules.RunUsage()
            updated, account, run, delta = rules.settle(r, account, run, limits, billed, final, now_ms, kind)
            writes = [
                (_UPDATE_RESERVATION, _reservation_params(updated)),
                self._account_write(r.tenant, r.model_class, account),
                self._event_write(updated, delta, now_ms),
            ]
            if r.run_id is not None and run is not None:
                writes.append(self._run_write(r.tenant, r.run_id, run))
            await tx.batch(writes)
            return updated

    async def settle(
        self, reservation_id: str, input_tokens: int, output_tokens: int, gpu_ms: float, final: bool = False
    ) -> Reservation:
        rules.check_amounts(input_tokens, output_tokens, gpu_ms, "settle")
        return await self._close(reservation_id, Usage(input_tokens, output_tokens, float(gpu_ms)), final, "settle")

    async def cancel(self, reservation_id: str, consumed: Usage) -> Reservation:
        return await self._close(reservation_id, check_consumed(consumed), True, "cancel")

    async def enqueue(self, reservation_id: str) -> Reservation:
        return await self._queue_step(reservation_id, enter=True)

    async def dequeue(self, reservation_id: str) -> Reservation:
        return await self._queue_step(reservation_id, enter=False)

    async def _queue_step(self, reservation_id: str, enter: bool) -> Reservation:
        async with self._transaction() as tx:
            loaded = await self._load_for_update(tx, reservation_id, with_clock=False)
            r, account = loaded.reservation, loaded.account
            changed = (
                rules.enqueue(r, account, self.limits(r.tenant, r.model_class)) if enter else rules.dequeue(r, account)
            )
            if changed is None:
                return r
            updated, account = changed
            await tx.batch(
                [
                    (_UPDATE_RESERVATION, _reservation_params(updated)),
                    self._account_write(r.tenant, r.model_class, account),
                ]
            )
            return updated

    async def account(self, tenant: str, model_class: str = "default") -> rules.Account:
        async with self._transaction() as tx:
            return await self._account(tx, tenant, model_class)

    async def get(self, reservation_id: str) -> Reservation:
        async with self._transaction() as tx:
            return await self._load(tx, reservation_id, lock=False)

    async def reservations(self, tenant: str | None = None, status: str | None = None) -> list[Reservation]:
        check_name(tenant, "tenant", optional=True)
        if status is not None and status not in STATUSES:
            raise InvalidUsage(f"status must be one of {', '.join(STATUSES)}, got {status!r:.80}")
        async with self._transaction() as tx:
            rows = await tx.fetchall(
                f"SELECT {_RESERVATION_COLUMNS} FROM fg_reservations WHERE "
                "(CAST(:tenant AS TEXT) IS NULL OR tenant = :tenant) AND (CAST(:status AS TEXT) IS NULL OR status = :status) "
                "ORDER BY created_ms, id",
                {"tenant": tenant, "status": status},
            )
        return [_reservation(row) for row in rows]

    async def events(self, tenant: str | None = None) -> list[Event]:
        check_name(tenant, "tenant", optional=True)
        async with self._transaction() as tx:
            rows = await tx.fetchall(
                "SELECT seq, tenant, reservation_id, kind, requests, input_tokens, output_tokens, "
                "gpu_ms, overage_gpu_ms, at_ms FROM fg_events WHERE (CAST(:tenant AS TEXT) IS NULL OR "
                "tenant = :tenant) ORDER BY seq",
                {"tenant": tenant},
            )
        return [
            Event(int(a), b, c, d, int(e), int(f), int(g), float(h), float(i), float(j))
            for a, b, c, d, e, f, g, h, i, j in rows
        ]

    async def usage(self, tenant: str, window_s: float) -> TenantUsage:
        check_name(tenant, "tenant")
        window_s = check_window(window_s)
        async with self._transaction() as tx:
            now_ms = await self._now_ms(tx)
            rows = await tx.fetchall(
                "SELECT seq, tenant, reservation_id, kind, requests, input_tokens, output_tokens, "
                "gpu_ms, overage_gpu_ms, at_ms FROM fg_events WHERE tenant = :tenant AND "
                "at_ms >= :since ORDER BY seq",
                {"tenant": tenant, "since": now_ms - window_s * 1e3},
            )
            statuses = await tx.fetchall(
                "SELECT status, COUNT(*) FROM fg_reservations WHERE tenant = :tenant GROUP BY status",
                {"tenant": tenant},
            )
        events = [
            Event(int(a), b, c, d, int(e), int(f), int(g), float(h), float(i), float(j))
            for a, b, c, d, e, f, g, h, i, j in rows
        ]
        by_status = {s: int(n) for s, n in statuses}
        return usage_from_events(tenant, window_s, events, by_status.get("open", 0), by_status)

    async def heartbeat(self, reservation_id: str) -> None:
        async with self._transaction() as tx:
            r = await self._load(tx, reservation_id, lock=False)
            if r.is_final:
                return
            now_ms = await self._now_ms(tx)
            await tx.execute(
                "INSERT INTO fg_heartbeats (reservation_id, beat_ms) VALUES (:id, :now) ON CONFLICT "
                "(reservation_id) DO UPDATE SET beat_ms = excluded.beat_ms",
                {"id": r.id, "now": now_ms},
            )

    async def _last_beat_ms(self, r: Reservation) -> tuple[float | None, float]:
        """(its last heartbeat or None, now), ms on the ledger clock."""
        async with self._transaction() as tx:
            now_ms = await self._now_ms(tx)
            row = await tx.fetchone("SELECT beat_ms FROM fg_heartbeats WHERE reservation_id = :id", {"id": r.id})
        return (float(row[0]) if row is not None else None), now_ms

    async def expire_due(self, is_running: IsRunning | None = None) -> list[Reservation]:
        async with self._transaction() as tx:
            now_ms = await self._now_ms(tx)
            await tx.execute(
                "DELETE FROM fg_heartbeats WHERE reservation_id IN (SELECT id FROM fg_reservations "
                "WHERE status <> 'open')"
            )
            rows = await tx.fetchall(
                f"SELECT {_RESERVATION_COLUMNS} FROM fg_reservations WHERE status = 'open' AND "
                "expires_at_ms <= :now AND tenant NOT IN (SELECT tenant FROM fg_frozen) "
                "ORDER BY expires_at_ms",
                {"now": now_ms},
            )
        expired = []
        for r in map(_reservation, rows):
            ttl_ms = self.limits(r.tenant, r.model_class).reservation_ttl_s * 1000.0
            if is_running is not None:
                running, since_ms = await is_running(r), None
            else:  # the heartbeat registry: running if beaten within the TTL, and only a TTL from that beat
                since_ms, now_ms = await self._last_beat_ms(r)
                running = since_ms is not None and now_ms - since_ms <= ttl_ms
            if running:
                async with self._transaction() as tx:
                    base_ms = since_ms if since_ms is not None else await self._now_ms(tx)
                    await tx.execute(
                        "UPDATE fg_reservations SET expires_at_ms = :at WHERE id = :id AND status = 'open'",
                        {"at": base_ms + ttl_ms, "id": r.id},
                    )
                continue
            try:
                current = await self.get(r.id)
                expired.append(await self._close(r.id, current.billed, True, "expire"))
            except ReservationFinal:
                continue  # settled meanwhile
        return expired

    async def freeze(self, tenant: str, reason: str) -> None:
        async with self._transaction() as tx:
            now_ms = await self._now_ms(tx)
            await tx.execute(
                "INSERT INTO fg_frozen (tenant, reason, at_ms) VALUES (:tenant, :reason, :now) ON CONFLICT "
                "(tenant) DO UPDATE SET reason = excluded.reason, at_ms = excluded.at_ms",
                {"tenant": tenant, "reason": reason, "now": now_ms},
            )

    async def unfreeze(self, tenant: str) -> None:
        async with self._transaction() as tx:
            await tx.execute("DELETE FROM fg_frozen WHERE tenant = :tenant", {"tenant": tenant})

    async def frozen(self) -> dict[str, str]:
        async with self._transaction() as tx:
            rows = await tx.fetchall("SELECT tenant, reason FROM fg_frozen ORDER BY tenant")
        return {t: reason for t, reason in rows}

    async def add_charges(self, scope: str, deltas: dict[str, ChargeTotals]) -> dict[str, ChargeTotals]:
        statements = [
            (
                "INSERT INTO fg_charges (scope, tenant, gpu_ms, input_tokens, output_tokens) "
                "VALUES (:scope, :tenant, :gpu_ms, :input, :output) ON CONFLICT (scope, tenant) DO UPDATE SET "
                "gpu_ms = fg_charges.gpu_ms + excluded.gpu_ms, "
                "input_tokens = fg_charges.input_tokens + excluded.input_tokens, "
                "output_tokens = fg_charges.output_tokens + excluded.output_tokens",
                {
                    "scope": scope,
                    "tenant": tenant,
                    "gpu_ms": float(gpu_ms),
                    "input": int(tokens_in),
                    "output": int(tokens_out),
                },
            )
            for tenant, (gpu_ms, tokens_in, tokens_out) in sorted(deltas.items())
        ]
        statements.append(
            (
                "SELECT tenant, gpu_ms, input_tokens, output_tokens FROM fg_charges WHERE scope = :scope",
                {"scope": scope},
            )
        )
        async with self._transaction() as tx:
            rows = (await tx.batch(statements))[-1]
        return {
            tenant: (float(gpu_ms), int(tokens_in), int(tokens_out)) for tenant, gpu_ms, tokens_in, tokens_out in rows
        }

    async def share_occupancy(
        self, process: str, occupancy: dict[str, tuple[float, float]], stale_after_ms: float
    ) -> dict[str, tuple[float, float]]:
        """``Ledger.share_occupancy``: one row per (process, upstream) in ``fg_occupancy``; expired rows are
        deleted (a process that stopped). Raises ``LedgerUnavailable``."""
        async with self._transaction() as tx:
            now_ms = await self._now_ms(tx)
            statements = [
                (
                    "DELETE FROM fg_occupancy WHERE process = :process OR expires_at_ms <= :now",
                    {"process": process, "now": now_ms},
                )
            ]
            statements += [
                (
                    "INSERT INTO fg_occupancy (process, upstream, sequences, prefill_share, expires_at_ms) "
                    "VALUES (:process, :upstream, :sequences, :prefill_share, :expires)",
                    {
                        "process": process,
                        "upstream": upstream,
                        "sequences": float(sequences),
                        "prefill_share": float(prefill_share),
                        "expires": now_ms + stale_after_ms,
                    },
                )
                for upstream, (sequences, prefill_share) in sorted(occupancy.items())
            ]
            statements.append(
                (
                    "SELECT upstream, SUM(sequences), SUM(prefill_share) FROM fg_occupancy "
                    "WHERE process <> :process GROUP BY upstream",
                    {"process": process},
                )
            )
            rows = (await tx.batch(statements))[-1]
        return {upstream: (float(sequences), float(prefill_share)) for upstream, sequences, prefill_share in rows}


__all__ = ["TABLES", "AsyncIterator", "SqlLedger", "Tx"]
