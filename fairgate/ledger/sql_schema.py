"""The SQL backends' tables, their statements, and how rows map to the ledger's objects.

Statements use ``:name`` placeholders (``postgres.py`` rewrites them for psycopg); ``{real}`` and ``{serial}``
in ``TABLES`` are the dialect's float and auto-increment key types, ``{minute}`` its floor of ``at_ms / 60000``
(corrected in SQL where the division rounds up to the next minute).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from fairgate.ledger import rules
from fairgate.ledger.config import TENANT_ACCOUNT
from fairgate.ledger.model import Event, Reservation, Usage, reservation_from_record
from fairgate.ledger.usage_minutes import minute_of

Statement = tuple[str, dict[str, Any]]

TABLES = """
CREATE TABLE IF NOT EXISTS fg_accounts (
  tenant TEXT NOT NULL, model_class TEXT NOT NULL,
  requests_level {real}, requests_updated_ms {real} NOT NULL,
  input_level {real}, input_updated_ms {real} NOT NULL,
  output_level {real}, output_updated_ms {real} NOT NULL,
  concurrent INTEGER NOT NULL,
  gpu_window_start_ms {real} NOT NULL, gpu_window_used_ms {real} NOT NULL, gpu_total_used_ms {real} NOT NULL,
  queued INTEGER NOT NULL DEFAULT 0,
  spend_period_start_ms {real} NOT NULL DEFAULT 0, spend_used_micros {real} NOT NULL DEFAULT 0,
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
  price_input_micros {real} NOT NULL DEFAULT 0, price_output_micros {real} NOT NULL DEFAULT 0,
  price_gpu_micros {real} NOT NULL DEFAULT 0,
  UNIQUE (tenant, request_id));
CREATE INDEX IF NOT EXISTS fg_reservations_open ON fg_reservations (status, expires_at_ms);
CREATE TABLE IF NOT EXISTS fg_events (
  seq {serial}, tenant TEXT NOT NULL, reservation_id TEXT NOT NULL, kind TEXT NOT NULL,
  requests INTEGER NOT NULL, input_tokens BIGINT NOT NULL, output_tokens BIGINT NOT NULL,
  gpu_ms {real} NOT NULL, overage_gpu_ms {real} NOT NULL, at_ms {real} NOT NULL,
  spend_micros {real} NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS fg_events_tenant ON fg_events (tenant, at_ms);
CREATE TABLE IF NOT EXISTS fg_usage_minutes (
  tenant TEXT NOT NULL, minute BIGINT NOT NULL,
  requests BIGINT NOT NULL, input_tokens BIGINT NOT NULL, output_tokens BIGINT NOT NULL,
  gpu_ms {real} NOT NULL, overage_gpu_ms {real} NOT NULL, spend_micros {real} NOT NULL DEFAULT 0,
  PRIMARY KEY (tenant, minute));
INSERT INTO fg_usage_minutes (tenant, minute, requests, input_tokens, output_tokens, gpu_ms, overage_gpu_ms)
  SELECT tenant, m, SUM(requests), SUM(input_tokens), SUM(output_tokens), SUM(gpu_ms), SUM(overage_gpu_ms)
  FROM (SELECT tenant, {minute} - CASE WHEN {minute} * 60000 > at_ms THEN 1 ELSE 0 END AS m, requests,
        input_tokens, output_tokens, gpu_ms, overage_gpu_ms FROM fg_events) e
  WHERE NOT EXISTS (SELECT 1 FROM fg_usage_minutes) GROUP BY tenant, m;
CREATE TABLE IF NOT EXISTS fg_frozen (tenant TEXT PRIMARY KEY, reason TEXT NOT NULL, at_ms {real} NOT NULL);
CREATE TABLE IF NOT EXISTS fg_heartbeats (reservation_id TEXT PRIMARY KEY, beat_ms {real} NOT NULL);
CREATE TABLE IF NOT EXISTS fg_claims (reservation_id TEXT PRIMARY KEY, owner TEXT NOT NULL, until_ms {real} NOT NULL);
CREATE TABLE IF NOT EXISTS fg_charges (
  scope TEXT NOT NULL, tenant TEXT NOT NULL,
  gpu_ms {real} NOT NULL, input_tokens BIGINT NOT NULL, output_tokens BIGINT NOT NULL,
  PRIMARY KEY (scope, tenant));
CREATE TABLE IF NOT EXISTS fg_occupancy (
  process TEXT NOT NULL, upstream TEXT NOT NULL, sequences {real} NOT NULL, prefill_share {real} NOT NULL,
  expires_at_ms {real} NOT NULL, PRIMARY KEY (process, upstream));
"""

# Columns added since the tables were first made: a ledger made before them gains them (``ALTER TABLE ... ADD
# COLUMN`` with the default, by each backend at open), so an older file or schema keeps working; records older
# than prices read as free.
ADDED_COLUMNS = (
    ("fg_accounts", "spend_period_start_ms"),
    ("fg_accounts", "spend_used_micros"),
    ("fg_reservations", "price_input_micros"),
    ("fg_reservations", "price_output_micros"),
    ("fg_reservations", "price_gpu_micros"),
    ("fg_events", "spend_micros"),
    ("fg_usage_minutes", "spend_micros"),
)


def add_column(table: str, column: str, real: str) -> str:
    """The statement adding ``column`` (a ``real`` defaulting to 0) to ``table``."""
    return f"ALTER TABLE {table} ADD COLUMN {column} {real} NOT NULL DEFAULT 0"


RESERVATION_COLUMNS = (
    "id, tenant, request_id, model_class, run_id, tool_round, input_tokens, max_output_tokens, "
    "gpu_ms_estimate, status, billed_input_tokens, billed_output_tokens, billed_gpu_ms, "
    "overage_gpu_ms, created_ms, expires_at_ms, final_ms, queued, price_input_micros, price_output_micros, "
    "price_gpu_micros"
)
ACCOUNT_FIELDS = tuple(f.name for f in fields(rules.Account))
RESERVATION_FIELDS = tuple(c.strip() for c in RESERVATION_COLUMNS.split(","))
INSERT_RESERVATION = (
    f"INSERT INTO fg_reservations ({RESERVATION_COLUMNS}) VALUES ({', '.join(':' + c for c in RESERVATION_FIELDS)})"
)
UPDATE_RESERVATION = (
    "UPDATE fg_reservations SET status = :status, billed_input_tokens = :billed_input_tokens, "
    "billed_output_tokens = :billed_output_tokens, billed_gpu_ms = :billed_gpu_ms, "
    "overage_gpu_ms = :overage_gpu_ms, expires_at_ms = :expires_at_ms, final_ms = :final_ms, "
    "queued = :queued, price_input_micros = :price_input_micros, price_output_micros = :price_output_micros, "
    "price_gpu_micros = :price_gpu_micros WHERE id = :id"
)
INSERT_EVENT = (
    "INSERT INTO fg_events (tenant, reservation_id, kind, requests, input_tokens, output_tokens, "
    "gpu_ms, overage_gpu_ms, at_ms, spend_micros) VALUES (:tenant, :rid, :kind, :requests, :input_tokens, "
    ":output_tokens, :gpu_ms, :overage_gpu_ms, :at_ms, :spend_micros)"
)
SAVE_RUN = (
    "INSERT INTO fg_runs (tenant, run_id, model_calls, tool_rounds, tokens) VALUES (:tenant, :run_id, "
    ":model_calls, :tool_rounds, :tokens) ON CONFLICT (tenant, run_id) DO UPDATE SET "
    "model_calls = excluded.model_calls, tool_rounds = excluded.tool_rounds, tokens = excluded.tokens"
)
# One read for a settle/cancel/expire: the reservation, whether its tenant is frozen, its class's account, the
# tenant-wide account (TENANT_ACCOUNT) and its run.
LOAD_FOR_CLOSE = (
    "SELECT "
    + ", ".join(f"r.{c}" for c in RESERVATION_FIELDS)
    + ", f.tenant, a.tenant, "
    + ", ".join(f"a.{c}" for c in ACCOUNT_FIELDS)
    + ", w.tenant, "
    + ", ".join(f"w.{c}" for c in ACCOUNT_FIELDS)
    + ", u.model_calls, u.tool_rounds, u.tokens FROM fg_reservations r"
    " LEFT JOIN fg_frozen f ON f.tenant = r.tenant"
    " LEFT JOIN fg_accounts a ON a.tenant = r.tenant AND a.model_class = r.model_class"
    f" LEFT JOIN fg_accounts w ON w.tenant = r.tenant AND w.model_class = '{TENANT_ACCOUNT}'"
    " LEFT JOIN fg_runs u ON u.tenant = r.tenant AND u.run_id = r.run_id WHERE r.id = :id"
)
SAVE_ACCOUNT = (
    f"INSERT INTO fg_accounts (tenant, model_class, {', '.join(ACCOUNT_FIELDS)}) VALUES (:tenant, "
    f":model_class, {', '.join(':' + f for f in ACCOUNT_FIELDS)}) ON CONFLICT (tenant, model_class) "
    f"DO UPDATE SET {', '.join(f'{f} = excluded.{f}' for f in ACCOUNT_FIELDS)}"
)
EVENT_COLUMNS = (
    "seq, tenant, reservation_id, kind, requests, input_tokens, output_tokens, gpu_ms, overage_gpu_ms, at_ms, "
    "spend_micros"
)
SELECT_ACCOUNT = (
    f"SELECT {', '.join(ACCOUNT_FIELDS)} FROM fg_accounts WHERE tenant = :tenant AND model_class = :model_class"
)
# The event's amounts added to its tenant's minute (usage_minutes.py); written with every event.
ADD_TO_MINUTE = (
    "INSERT INTO fg_usage_minutes (tenant, minute, requests, input_tokens, output_tokens, gpu_ms, overage_gpu_ms, "
    "spend_micros) VALUES (:tenant, :minute, :requests, :input_tokens, :output_tokens, :gpu_ms, :overage_gpu_ms, "
    ":spend_micros) "
    "ON CONFLICT (tenant, minute) DO UPDATE SET requests = fg_usage_minutes.requests + excluded.requests, "
    "input_tokens = fg_usage_minutes.input_tokens + excluded.input_tokens, "
    "output_tokens = fg_usage_minutes.output_tokens + excluded.output_tokens, "
    "gpu_ms = fg_usage_minutes.gpu_ms + excluded.gpu_ms, "
    "overage_gpu_ms = fg_usage_minutes.overage_gpu_ms + excluded.overage_gpu_ms, "
    "spend_micros = fg_usage_minutes.spend_micros + excluded.spend_micros"
)
_AMOUNTS = "requests, input_tokens, output_tokens, gpu_ms, overage_gpu_ms, spend_micros"
# usage(): the whole minutes in the window, then the events of its first, partial minute (added up in Python,
# in an order that does not depend on the backend: usage_minutes.usage_from_totals).
SELECT_MINUTES = f"SELECT {_AMOUNTS} FROM fg_usage_minutes WHERE tenant = :tenant AND minute >= :first"
SELECT_EDGE_EVENTS = f"SELECT {_AMOUNTS} FROM fg_events WHERE tenant = :tenant AND at_ms >= :since AND at_ms < :edge"
SELECT_RUN = "SELECT model_calls, tool_rounds, tokens FROM fg_runs WHERE tenant = :tenant AND run_id = :run_id"


def reservation(row: tuple[Any, ...]) -> Reservation:
    """A reservation from a row of ``RESERVATION_COLUMNS``."""
    return reservation_from_record(dict(zip(RESERVATION_FIELDS, row, strict=True)), int, bool)


def reservation_params(r: Reservation) -> dict[str, Any]:
    """``r`` as the parameters of ``INSERT_RESERVATION`` / ``UPDATE_RESERVATION``."""
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
        "price_input_micros": r.price.input_micros_per_token,
        "price_output_micros": r.price.output_micros_per_token,
        "price_gpu_micros": r.price.gpu_micros_per_ms,
    }


def event(row: tuple[Any, ...]) -> Event:
    """An ``Event`` from a row of ``EVENT_COLUMNS``."""
    seq, tenant, rid, kind, requests, input_tokens, output_tokens, gpu_ms, overage, at_ms, spend = row
    return Event(
        int(seq),
        tenant,
        rid,
        kind,
        int(requests),
        int(input_tokens),
        int(output_tokens),
        float(gpu_ms),
        float(overage),
        float(at_ms),
        float(spend),
    )


_RUN_FIELDS = tuple(f.name for f in fields(rules.RunUsage))
_USAGE_FIELDS = tuple(f.name for f in fields(Usage))


def _values(record: object, names: tuple[str, ...]) -> dict[str, Any]:
    """``record``'s fields ``names`` as statement parameters: read one by one, as ``dataclasses.asdict`` would
    deep-copy every value (four calls a request on the request path)."""
    return {name: getattr(record, name) for name in names}


def account_write(tenant: str, model_class: str, account: rules.Account) -> Statement:
    """The upsert of an account."""
    return SAVE_ACCOUNT, {"tenant": tenant, "model_class": model_class, **_values(account, ACCOUNT_FIELDS)}


def run_write(tenant: str, run_id: str, run: rules.RunUsage) -> Statement:
    """The upsert of an agent run's counters."""
    return SAVE_RUN, {"tenant": tenant, "run_id": run_id, **_values(run, _RUN_FIELDS)}


def event_write(r: Reservation, delta: rules.Delta, now_ms: float) -> Statement:
    """The insert of the event ``delta`` of ``r`` at ``now_ms``."""
    return INSERT_EVENT, {
        "tenant": r.tenant,
        "rid": r.id,
        "kind": delta.kind,
        "requests": delta.requests,
        **_values(delta.billed, _USAGE_FIELDS),
        "overage_gpu_ms": delta.overage_gpu_ms,
        "at_ms": now_ms,
        "spend_micros": delta.spend_micros,
    }


def event_writes(r: Reservation, delta: rules.Delta, now_ms: float) -> list[Statement]:
    """The insert of the event ``delta`` of ``r`` at ``now_ms``, and its addition to the tenant's minute."""
    insert = event_write(r, delta, now_ms)
    return [insert, (ADD_TO_MINUTE, {**insert[1], "minute": minute_of(now_ms)})]


def forget_run_state(reservation_id: str) -> list[Statement]:
    """The deletes of a reservation's heartbeat and run claim (a closed one's, before it re-opens: the sweep
    forgets them only later)."""
    return [
        (f"DELETE FROM {table} WHERE reservation_id = :id", {"id": reservation_id})
        for table in ("fg_heartbeats", "fg_claims")
    ]


def reservation_write(r: Reservation) -> Statement:
    """The update of ``r``'s status, billed amounts, expiry and queue place."""
    return UPDATE_RESERVATION, reservation_params(r)
