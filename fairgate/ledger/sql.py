"""The ledger on a SQL database: the rules of ``rules.py`` applied inside one transaction per call.

Dialects (``sqlite.py``, ``postgres.py``) supply the transaction, the tenant lock and the clock; the tables,
statements and row codecs are in ``sql_schema.py``. PostgreSQL replaces the request path's steps (``_reserve``,
``_close``, ``_claim``, ``_queue_step``) by calls of server-side functions that apply the same rules
(``postgres_functions.sql``); SQLite runs them here.
"""

from __future__ import annotations

from abc import abstractmethod
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, replace
from typing import Any, Protocol

from fairgate.ledger import rules
from fairgate.ledger import sql_schema as schema
from fairgate.ledger.backend import Backend
from fairgate.ledger.base import ChargeTotals, Event, new_reservation_id, tenant_tag
from fairgate.ledger.checks import (
    check_account_args,
    check_charges,
    check_filters,
    check_freeze,
    check_reservation_id,
    check_window,
)
from fairgate.ledger.config import TENANT_ACCOUNT, Limits
from fairgate.ledger.model import (
    Reservation,
    ReservationFinal,
    ReservationNotFound,
    RunClaim,
    SettlementFrozen,
    TenantUsage,
    Usage,
    check_name,
)
from fairgate.ledger.sql_schema import TABLES, Statement
from fairgate.ledger.usage_minutes import MINUTE_MS, first_full_minute, usage_from_totals


class Tx(Protocol):
    """One open transaction."""

    async def fetchone(self, sql: str, params: dict[str, Any] | None = None) -> tuple[Any, ...] | None: ...
    async def fetchall(self, sql: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]: ...
    async def execute(self, sql: str, params: dict[str, Any] | None = None) -> None: ...
    async def batch(self, statements: list[Statement]) -> list[list[tuple[Any, ...]]]:
        """Run ``statements`` in order, in one round trip where the driver can; every statement's rows."""
        ...


_SELECT_CLAIM = "SELECT owner, until_ms FROM fg_claims WHERE reservation_id = :id"
_BY_REQUEST = "tenant = :tenant AND request_id = :request_id"
# The run claim on the request id's reservation, read with the reserve's other reads (its id is not known yet).
_SELECT_CLAIM_BY_REQUEST = (
    f"SELECT owner, until_ms FROM fg_claims WHERE reservation_id = (SELECT id FROM fg_reservations WHERE {_BY_REQUEST})"
)
_SAVE_CLAIM = (
    "INSERT INTO fg_claims (reservation_id, owner, until_ms) VALUES (:id, :owner, :until) "
    "ON CONFLICT (reservation_id) DO UPDATE SET owner = excluded.owner, until_ms = excluded.until_ms"
)
_SAVE_HEARTBEAT = (
    "INSERT INTO fg_heartbeats (reservation_id, beat_ms) VALUES (:id, :now) ON CONFLICT "
    "(reservation_id) DO UPDATE SET beat_ms = excluded.beat_ms"
)


def tag_of(reservation_id: object) -> str:
    """The tenant tag a reservation id starts with. Raises ``InvalidUsage`` (not a non-empty string),
    ``ReservationNotFound`` (a malformed id)."""
    tag = check_reservation_id(reservation_id).split("-", 1)[0]
    if len(tag) != 16 or any(c not in "0123456789abcdef" for c in tag):
        raise ReservationNotFound(f"no reservation {reservation_id!r}")
    return tag


@dataclass(frozen=True)
class _Loaded:
    """What ``SqlLedger._load_for_update`` read."""

    reservation: Reservation
    frozen: bool
    accounts: dict[str, rules.Account]  # the reservation's class's and the tenant-wide (fresh where not stored)
    run_values: tuple[Any, ...]  # the run's counters (all None when the reservation has no run)
    now_ms: float | None  # the backend's clock, if it has one in SQL
    also: list[list[tuple[Any, ...]]]  # the rows of the caller's further reads, in order


class SqlLedger(Backend):
    """``Ledger`` over SQL; subclasses provide ``_transaction`` and ``_now_ms`` (and may take a tenant lock
    with ``_lock_statement``, read the clock in SQL with ``_now_statement``)."""

    @abstractmethod
    def _transaction(self) -> AbstractAsyncContextManager[Tx]:
        """A write transaction (committed on success, rolled back on error)."""

    @abstractmethod
    async def _now_ms(self, tx: Tx) -> float:
        """The ledger clock, ms since the epoch."""

    def _read_transaction(self) -> AbstractAsyncContextManager[Tx]:
        """A transaction that only reads (default: ``_transaction``; SQLite's takes no write lock)."""
        return self._transaction()

    def _small_transaction(self) -> AbstractAsyncContextManager[Tx]:
        """A write transaction of a few rows found by key (a heartbeat, a reservation read, the shared counters), so
        one the backend may bound in time as it bounds a call (default: ``_transaction``)."""
        return self._transaction()

    def _lock_statement(self, tag: str) -> Statement | None:
        """A statement that takes the tenant lock for tenant tag ``tag`` (None: the transaction is enough)."""
        return None

    def _now_statement(self) -> Statement | None:
        """A statement returning the clock (ms) as its one value (None: ``_now_ms`` needs no query)."""
        return None

    async def _write(self, tx: Tx, statements: list[Statement]) -> None:
        """Run the writes ``statements`` (no rows wanted) in ``tx``, in order."""
        await tx.batch(statements)

    # --- request path --------------------------------------------------------------------------
    async def _reserve(
        self, args: rules.ReserveArgs, limits: Limits, claim_owner: str | None, claim_lease_ms: float
    ) -> Reservation:
        """Reads (the tenant lock, an earlier reservation of the request id, the accounts charged, the run, its
        run claim when one is asked, the clock) in one round trip, then writes in one. A reservation the request
        id made before is returned unless it re-opens (``rules.reopens``). ``balances``: the last account of
        ``books`` (the binding one) as written, or as read when nothing is; ``claim``: ``rules.claim_on_reserve``."""
        books = self.books(args.tenant, args.model_class)
        lock, clock = self._lock_statement(tenant_tag(args.tenant)), self._now_statement()
        by_request = {"tenant": args.tenant, "request_id": args.request_id}
        reads = [s for s in (lock,) if s is not None]
        reads.append((f"SELECT {schema.RESERVATION_COLUMNS} FROM fg_reservations WHERE {_BY_REQUEST}", by_request))
        reads += [(schema.SELECT_ACCOUNT, {"tenant": args.tenant, "model_class": key}) for key, _ in books]
        if args.run_id is not None:
            reads.append((schema.SELECT_RUN, {"tenant": args.tenant, "run_id": args.run_id}))
        if claim_owner is not None:
            reads.append((_SELECT_CLAIM_BY_REQUEST, by_request))
        if clock is not None:
            reads.append(clock)
        async with self._transaction() as tx:
            rows = await tx.batch(reads)
            rows = rows[1:] if lock is not None else rows
            existing = rules.check_retry(schema.reservation(rows[0][0]), args) if rows[0] else None
            accounts = [rules.Account(*found[0]) if found else rules.Account() for found in rows[1 : 1 + len(books)]]
            now_ms = float(rows[-1][0][0]) if clock is not None else await self._now_ms(tx)
            claim_rows = rows[-2 if clock is not None else -1] if claim_owner is not None else []
            if existing is not None and not rules.reopens(existing):
                claim, writes = self._claim_step(existing, claim_rows, claim_owner, claim_lease_ms, now_ms)
                if writes:
                    await self._write(tx, writes)
                return replace(existing, balances=accounts[-1], claim=claim)
            run_rows = rows[1 + len(books)] if args.run_id is not None else []
            run = None if args.run_id is None else (rules.RunUsage(*run_rows[0]) if run_rows else rules.RunUsage())
            charged, run = rules.reserve(
                [(account, book_limits) for account, (_, book_limits) in zip(accounts, books, strict=True)],
                run,
                args,
                now_ms,
                again=existing is not None,
            )
            if existing is None:
                r = _new_reservation(args, limits, now_ms)
                writes = [(schema.INSERT_RESERVATION, schema.reservation_params(r))]
            else:
                r = rules.reopened(existing, limits, now_ms, args.price)
                writes = [schema.reservation_write(r), *schema.forget_run_state(r.id)]
            writes += self._account_writes(r, charged)
            writes += schema.event_writes(r, rules.Delta("reserve", requests=int(existing is None)), now_ms)
            if args.run_id is not None and run is not None:
                writes.append(schema.run_write(args.tenant, args.run_id, run))
            claim, claim_writes = self._claim_step(r, [], claim_owner, claim_lease_ms, now_ms)  # none held on it
            await self._write(tx, writes + claim_writes)
            return replace(r, balances=charged[-1], claim=claim)

    @staticmethod
    def _claim_step(
        r: Reservation, claim_rows: list[tuple[Any, ...]], owner: str | None, lease_ms: float, now_ms: float
    ) -> tuple[RunClaim | None, list[Statement]]:
        """The run claim ``owner`` asks for on ``r`` at ``now_ms`` (``rules.claim_on_reserve``; ``claim_rows``:
        the claim stored on it) and its writes (the claim and a heartbeat, when ``owner`` holds it); (None, [])
        when no claim is asked."""
        if owner is None:
            return None, []
        held = RunClaim(str(claim_rows[0][0]), float(claim_rows[0][1]), now_ms) if claim_rows else None
        decided = rules.claim_on_reserve(r, held, owner, lease_ms, now_ms)
        if decided is None or not decided.held_by(owner):
            return decided, []
        params = {"id": r.id, "owner": owner, "until": decided.until_ms, "now": now_ms}
        return decided, [(_SAVE_CLAIM, params), (_SAVE_HEARTBEAT, params)]

    async def _load_for_update(
        self, tx: Tx, reservation_id: str, with_clock: bool, also: tuple[Statement, ...] = ()
    ) -> _Loaded:
        """One round trip for a call on one reservation: the tenant's lock (if the backend takes one), the
        reservation with its tenant's frozen flag, its class's and the tenant-wide account and its run
        (``LOAD_FOR_CLOSE``), the statements ``also`` (their rows: ``_Loaded.also``), and the clock. Raises
        ``ReservationNotFound``."""
        lock = self._lock_statement(tag_of(reservation_id))
        clock = self._now_statement() if with_clock else None
        reads = [s for s in (lock, (schema.LOAD_FOR_CLOSE, {"id": reservation_id}), *also, clock) if s is not None]
        rows = await tx.batch(reads)
        rows = rows[1:] if lock is not None else rows
        if not rows[0]:
            raise ReservationNotFound(f"no reservation {reservation_id!r}")
        row = rows[0][0]
        n, m = len(schema.RESERVATION_FIELDS), len(schema.ACCOUNT_FIELDS)
        r = schema.reservation(row[:n])
        accounts = {}
        for key, at in ((r.model_class, n + 1), (TENANT_ACCOUNT, n + 2 + m)):  # each: a key column, then fields
            accounts[key] = rules.Account(*row[at + 1 : at + 1 + m]) if row[at] is not None else rules.Account()
        now_ms = float(rows[-1][0][0]) if clock is not None else None
        return _Loaded(r, bool(row[n]), accounts, row[n + 3 + 2 * m :], now_ms, rows[1 : 1 + len(also)])

    def _books(self, loaded: _Loaded, kind: str = "settle") -> list[rules.Book]:
        """The accounts ``loaded.reservation`` was charged to, as loaded, with their limits; for a tenant no
        longer configured, ``UnknownTenant``, but for an expiry (``Ledger.closing_books``)."""
        r = loaded.reservation
        books = self.closing_books if kind == "expire" else self.books
        return [(loaded.accounts[key], limits) for key, limits in books(r.tenant, r.model_class)]

    def _account_writes(self, r: Reservation, accounts: list[rules.Account]) -> list[Statement]:
        """The upserts of the accounts ``r`` was charged to (``books`` order)."""
        keys = self.account_keys(r.tenant, r.model_class)
        return [schema.account_write(r.tenant, key, acc) for key, acc in zip(keys, accounts, strict=True)]

    async def _close(self, reservation_id: str, billed: Usage | None, final: bool, kind: str) -> Reservation:
        """``Backend._close``; ``billed`` None: what the reservation holds when its row is locked (the sweep's
        expiry: a settlement landing between a read and the close must not make the close bill less)."""
        async with self._transaction() as tx:
            loaded = await self._load_for_update(tx, reservation_id, with_clock=True)
            r, run_values = loaded.reservation, loaded.run_values
            billed = r.billed if billed is None else billed
            if r.is_final:
                return rules.check_final_again(r, billed, final, kind)
            if loaded.frozen:
                raise SettlementFrozen(f"automatic settlement is frozen for tenant {r.tenant!r}")
            if r.billed == billed and not final:
                return r  # a repeated partial settlement: nothing new
            now_ms = loaded.now_ms if loaded.now_ms is not None else await self._now_ms(tx)
            run = None
            if r.run_id is not None:
                run = rules.RunUsage(*run_values) if run_values[0] is not None else rules.RunUsage()
            updated, accounts, run, delta = rules.settle(r, self._books(loaded, kind), run, billed, final, now_ms, kind)
            writes = [
                schema.reservation_write(updated),
                *self._account_writes(r, accounts),
                *schema.event_writes(updated, delta, now_ms),
            ]
            if r.run_id is not None and run is not None:
                writes.append(schema.run_write(r.tenant, r.run_id, run))
            await self._write(tx, writes)
            return updated

    async def _claim(self, reservation_id: str, owner: str, lease_ms: float) -> RunClaim:
        """Under the tenant's lock: the reservation, its claim and the clock (one read); the claim and a heartbeat
        written when ``owner`` takes it."""
        async with self._transaction() as tx:
            loaded = await self._load_for_update(
                tx, reservation_id, with_clock=True, also=((_SELECT_CLAIM, {"id": reservation_id}),)
            )
            r = loaded.reservation
            if r.is_final:
                raise ReservationFinal(f"reservation {r.id!r} is {r.status} already")
            now_ms = loaded.now_ms if loaded.now_ms is not None else await self._now_ms(tx)
            (claim_rows,) = loaded.also
            held = RunClaim(str(claim_rows[0][0]), float(claim_rows[0][1]), now_ms) if claim_rows else None
            decided = rules.claim(held, owner, lease_ms, now_ms)
            if decided.held_by(owner):
                params = {"id": r.id, "owner": owner, "until": decided.until_ms, "now": now_ms}
                await self._write(tx, [(_SAVE_CLAIM, params), (_SAVE_HEARTBEAT, params)])
            return decided

    async def _queue_step(self, reservation_id: str, enter: bool) -> Reservation:
        async with self._transaction() as tx:
            loaded = await self._load_for_update(tx, reservation_id, with_clock=False)
            r = loaded.reservation
            keys = self.account_keys(r.tenant, r.model_class)
            changed = (
                rules.enqueue(r, self._books(loaded))
                if enter
                else rules.dequeue(r, [loaded.accounts[key] for key in keys])
            )
            if changed is None:
                return r
            updated, accounts = changed
            await self._write(tx, [schema.reservation_write(updated), *self._account_writes(r, accounts)])
            return updated

    async def account(self, tenant: str, model_class: str = "default") -> rules.Account:
        check_account_args(tenant, model_class)
        key = self.account_key(tenant, model_class)
        async with self._read_transaction() as tx:
            row = await tx.fetchone(schema.SELECT_ACCOUNT, {"tenant": tenant, "model_class": key})
        return rules.Account() if row is None else rules.Account(*row)

    async def _load(self, tx: Tx, reservation_id: str) -> Reservation:
        row = await tx.fetchone(
            f"SELECT {schema.RESERVATION_COLUMNS} FROM fg_reservations WHERE id = :id",
            {"id": check_reservation_id(reservation_id)},
        )
        if row is None:
            raise ReservationNotFound(f"no reservation {reservation_id!r}")
        return schema.reservation(row)

    async def get(self, reservation_id: str) -> Reservation:
        async with self._small_transaction() as tx:
            return await self._load(tx, reservation_id)

    async def heartbeat(self, reservation_id: str) -> None:
        async with self._small_transaction() as tx:
            r = await self._load(tx, reservation_id)
            if r.is_final:
                return
            now_ms = await self._now_ms(tx)
            await tx.execute(_SAVE_HEARTBEAT, {"id": r.id, "now": now_ms})

    # --- operator --------------------------------------------------------------------------------
    async def reservations(self, tenant: str | None = None, status: str | None = None) -> list[Reservation]:
        check_filters(tenant, status)
        async with self._transaction() as tx:
            rows = await tx.fetchall(
                f"SELECT {schema.RESERVATION_COLUMNS} FROM fg_reservations WHERE "
                "(CAST(:tenant AS TEXT) IS NULL OR tenant = :tenant) "
                "AND (CAST(:status AS TEXT) IS NULL OR status = :status) ORDER BY created_ms, id",
                {"tenant": tenant, "status": status},
            )
        return [schema.reservation(row) for row in rows]

    async def events(self, tenant: str | None = None) -> list[Event]:
        check_name(tenant, "tenant", optional=True)
        async with self._transaction() as tx:
            rows = await tx.fetchall(
                f"SELECT {schema.EVENT_COLUMNS} FROM fg_events WHERE (CAST(:tenant AS TEXT) IS NULL OR "
                "tenant = :tenant) ORDER BY seq",
                {"tenant": tenant},
            )
        return [schema.event(row) for row in rows]

    async def usage(self, tenant: str, window_s: float) -> TenantUsage:
        """The window's whole minutes from ``fg_usage_minutes`` and its first, partial minute's events
        (``usage_minutes``), in a read transaction."""
        check_name(tenant, "tenant")
        window_s = check_window(window_s)
        async with self._read_transaction() as tx:
            since = await self._now_ms(tx) - window_s * 1e3
            first = first_full_minute(since)
            edge = {"tenant": tenant, "since": since, "edge": float(first * MINUTE_MS)}
            minutes, edge_events, statuses = await tx.batch(
                [
                    (schema.SELECT_MINUTES, {"tenant": tenant, "first": first}),
                    (schema.SELECT_EDGE_EVENTS, edge),
                    ("SELECT status, COUNT(*) FROM fg_reservations WHERE tenant = :tenant GROUP BY status", edge),
                ]
            )
        by_status = {status: int(n) for status, n in statuses}
        return usage_from_totals(tenant, window_s, [*minutes, *edge_events], by_status)

    async def freeze(self, tenant: str, reason: str) -> None:
        check_freeze(tenant, reason)
        async with self._small_transaction() as tx:
            now_ms = await self._now_ms(tx)
            await tx.execute(
                "INSERT INTO fg_frozen (tenant, reason, at_ms) VALUES (:tenant, :reason, :now) ON CONFLICT "
                "(tenant) DO UPDATE SET reason = excluded.reason, at_ms = excluded.at_ms",
                {"tenant": tenant, "reason": reason, "now": now_ms},
            )

    async def unfreeze(self, tenant: str) -> None:
        check_name(tenant, "tenant")
        async with self._small_transaction() as tx:
            await tx.execute("DELETE FROM fg_frozen WHERE tenant = :tenant", {"tenant": tenant})

    async def frozen(self) -> dict[str, str]:
        async with self._small_transaction() as tx:
            rows = await tx.fetchall("SELECT tenant, reason FROM fg_frozen ORDER BY tenant")
        return dict(rows)

    # --- coordination ----------------------------------------------------------------------------
    async def _due(self) -> list[Reservation]:
        """Also forgets the heartbeats and run claims of reservations closed since the last sweep."""
        async with self._transaction() as tx:
            now_ms = await self._now_ms(tx)
            for table in ("fg_heartbeats", "fg_claims"):
                await tx.execute(
                    f"DELETE FROM {table} WHERE reservation_id IN (SELECT id FROM fg_reservations "
                    "WHERE status <> 'open')"
                )
            rows = await tx.fetchall(
                f"SELECT {schema.RESERVATION_COLUMNS} FROM fg_reservations WHERE status = 'open' AND "
                "expires_at_ms <= :now AND tenant NOT IN (SELECT tenant FROM fg_frozen) "
                "ORDER BY expires_at_ms",
                {"now": now_ms},
            )
        return [schema.reservation(row) for row in rows]

    async def _last_beat_ms(self, r: Reservation) -> tuple[float | None, float]:
        async with self._small_transaction() as tx:
            now_ms = await self._now_ms(tx)
            row = await tx.fetchone("SELECT beat_ms FROM fg_heartbeats WHERE reservation_id = :id", {"id": r.id})
        return (float(row[0]) if row is not None else None), now_ms

    async def _extend(self, r: Reservation, ttl_s: float, since_ms: float | None) -> None:
        async with self._small_transaction() as tx:
            base_ms = since_ms if since_ms is not None else await self._now_ms(tx)
            await tx.execute(
                "UPDATE fg_reservations SET expires_at_ms = :at WHERE id = :id AND status = 'open'",
                {"at": base_ms + ttl_s * 1000.0, "id": r.id},
            )

    async def _expire(self, r: Reservation) -> Reservation | None:
        try:
            return await self._close(r.id, None, True, "expire")
        except ReservationFinal:
            return None  # settled meanwhile

    async def add_charges(self, scope: str, deltas: dict[str, ChargeTotals]) -> dict[str, ChargeTotals]:
        check_charges(scope, deltas)
        statements: list[Statement] = [
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
        async with self._small_transaction() as tx:
            rows = (await tx.batch(statements))[-1]
        return {
            tenant: (float(gpu_ms), int(tokens_in), int(tokens_out)) for tenant, gpu_ms, tokens_in, tokens_out in rows
        }

    async def share_occupancy(
        self, process: str, occupancy: dict[str, tuple[float, float]], stale_after_ms: float
    ) -> dict[str, tuple[float, float]]:
        """One row per (process, upstream) in ``fg_occupancy``; expired rows are deleted (a process that
        stopped)."""
        async with self._small_transaction() as tx:
            now_ms = await self._now_ms(tx)
            statements: list[Statement] = [
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


def _new_reservation(args: rules.ReserveArgs, limits: Limits, now_ms: float) -> Reservation:
    """The open reservation ``args`` make at ``now_ms``."""
    return Reservation(
        id=new_reservation_id(args.tenant),
        tenant=args.tenant,
        request_id=args.request_id,
        model_class=args.model_class,
        run_id=args.run_id,
        tool_round=args.tool_round,
        input_tokens=args.input_tokens,
        max_output_tokens=args.max_output_tokens,
        gpu_ms_estimate=float(args.gpu_ms_estimate),
        status="open",
        billed=Usage(),
        overage_gpu_ms=0.0,
        created_ms=now_ms,
        expires_at_ms=now_ms + limits.reservation_ttl_s * 1000.0,
        price=args.price,
    )


__all__ = ["TABLES", "SqlLedger", "Tx", "tag_of"]
