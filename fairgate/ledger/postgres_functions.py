"""The PostgreSQL ledger's request path as server-side functions (``postgres_functions.sql``, PL/pgSQL): what
each call sends, what it reads back, and how a refusal becomes the exception the SQLite backend raises.

Each call (reserve, which takes the run claim too when asked; claim, settle, cancel, an expiry, enqueue, dequeue) is
one statement, ``SELECT ... FROM "schema".fg_<call>(...)``, on an autocommit connection: one round trip and its own
transaction; or, in a batch of one tenant's calls (``postgres_batch``), one statement of one transaction through
its ``fg_try_<call>`` wrapper (the call in a subtransaction, its error as columns: ``try_call``). The function
takes the tenant's advisory lock, reads, applies ``rules.py``'s rules and writes; the lock is released when its
transaction ends, so it is never held across a round trip. The ledger's configuration
travels with the call: the limits of the accounts charged (``TenantQuota.accounts``), the price, the new
reservation's id and TTL, and the clock when the ledger has a fixed one (``clock``; otherwise the server's
``clock_timestamp()``).

A refusal is an error of SQLSTATE class ``FG`` raised before anything stays written (the statement rolls back);
``refusal`` maps it to ``QuotaExceeded`` (dimension, retry_after_s, limit, remaining), ``ReservationNotFound``,
``SettlementFrozen``, ``InvalidUsage``, ``ReservationFinal`` or ``UnknownTenant``, with the SQLite backend's
messages and values. Doubles in an error's detail are ``float8send``'s bytes in hex: exact.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from importlib import resources
from typing import Any

from fairgate.ledger import rules
from fairgate.ledger import sql_schema as schema
from fairgate.ledger.base import tenant_tag
from fairgate.ledger.config import TENANT_ACCOUNT, Limits, Quotas, TenantQuota, packed_limit_values
from fairgate.ledger.model import (
    InvalidUsage,
    LedgerError,
    QuotaExceeded,
    Reservation,
    ReservationFinal,
    ReservationNotFound,
    RunClaim,
    SettlementFrozen,
    UnknownTenant,
    Usage,
)

# The request path's calls (``call``); ``function_names`` are these and the helpers they call.
FUNCTIONS = ("fg_reserve", "fg_close", "fg_claim", "fg_queue_step")
# Limits that are whole numbers: a QuotaExceeded on them reports an int ``remaining``, as ``rules`` does.
INT_LIMITS = frozenset(
    {"max_tokens_per_request", "max_concurrent", "max_queued", "max_model_calls", "max_tool_rounds", "max_tokens"}
)
_LEDGER_NAME = re.compile(r"\bfg_[a-z_]+\b")
_CREATED = re.compile(r"^CREATE OR REPLACE FUNCTION (fg_[a-z_]+)\b", re.M)
_STATEMENT_END = "\n-- ;;\n"


def _source() -> str:
    return resources.files("fairgate.ledger").joinpath("postgres_functions.sql").read_text(encoding="utf-8")


def definitions(schema_name: str) -> list[str]:
    """The ``CREATE OR REPLACE FUNCTION`` statements, every ledger table, type and function named with its schema
    (no ``search_path``: nothing depends on the session)."""
    qualified = _LEDGER_NAME.sub(lambda m: f'"{schema_name}".{m.group(0)}', _source())
    return [part for part in qualified.split(_STATEMENT_END) if part.strip()]


@lru_cache(maxsize=1)
def function_names() -> tuple[str, ...]:
    """Every function ``definitions`` creates, the calls and their helpers, in the file's order: what ``_prepare``
    creates and, with ``create=False``, requires (a call finding a helper missing fails only when it runs)."""
    return tuple(_CREATED.findall(_source()))


# A book's limits as the functions read them (``postgres_functions.sql``'s header), kept per ``Limits``.
packed = lru_cache(maxsize=1024)(packed_limit_values)


def packed_books(books: Mapping[str, Limits]) -> list[float | None]:
    """Every book's ``packed`` limits, one after another, in ``books``' order."""
    return [value for limits in books.values() for value in packed(limits)]


@dataclass(frozen=True)
class TenantBooks:
    """A configured tenant's accounts with their limits, as ``fg_close`` and ``fg_queue_step`` take them: the
    tenant-wide one, then every model class with limits of its own (the function picks the reservation's).
    ``tenant`` None: no configured tenant has the reservation id's tag."""

    tenant: str | None
    by_key: dict[str, Limits] = field(default_factory=dict)

    @classmethod
    def of(cls, tenant: str, quota: TenantQuota) -> TenantBooks:
        return cls(tenant, {TENANT_ACCOUNT: quota.limits, **quota.by_model_class})

    def params(self) -> dict[str, Any]:
        """The tenant, keys and limits parameters (``fallback``: ``Ledger.closing_books``' limits for a tenant
        not configured)."""
        return {
            "tenant": self.tenant,
            "keys": list(self.by_key),
            "limits": packed_books(self.by_key),
            "fallback": list(packed(Limits())),
        }


UNCONFIGURED = TenantBooks(None)


def books_by_tag(quotas: Quotas) -> dict[str, TenantBooks]:
    """Every configured tenant's ``TenantBooks``, by the tag its reservation ids start with."""
    return {tenant_tag(name): TenantBooks.of(name, quota) for name, quota in quotas.tenants.items()}


def lock_key(tag: str) -> int:
    """The advisory lock of a tenant: its tag's 64 bits as the signed bigint ``pg_advisory_xact_lock`` takes."""
    return int(tag, 16) - (1 << 63)


_RESERVATION = ", ".join(f"(o.res).{c}" for c in schema.RESERVATION_FIELDS)
_BALANCES = ", ".join(f"(o.bal).{c}" for c in schema.ACCOUNT_FIELDS)
# Every parameter cast: psycopg types a Python int by its size, and a function is found by its argument types.
# The arrays go in binary (%b): the server's array_in parses text floats one by one (40,000 of the 2.5 million
# instructions a gateway request costs the backend, callgrind), and psycopg dumps them in half the time.
_ARGS = {
    "fg_reserve": "%(lock)s::int8, %(now)s::float8, %(id)s::text, %(tenant)s::text, %(request_id)s::text, "
    "%(model_class)s::text, %(run_id)s::text, %(tool_round)s::bool, %(input)s::int8, %(output)s::int8, "
    "%(estimate)s::float8, %(price)b::float8[], %(ttl_s)s::float8, %(keys)b::text[], %(limits)b::float8[], "
    "%(owner)s::text, %(lease_ms)s::float8",
    "fg_close": "%(lock)s::int8, %(now)s::float8, %(id)s::text, %(kind)s::text, %(final)s::bool, %(input)s::int8, "
    "%(output)s::int8, %(gpu_ms)s::float8, %(tenant)s::text, %(keys)b::text[], %(limits)b::float8[], "
    "%(fallback)b::float8[]",
    "fg_claim": "%(lock)s::int8, %(now)s::float8, %(id)s::text, %(owner)s::text, %(lease_ms)s::float8",
    "fg_queue_step": "%(lock)s::int8, %(id)s::text, %(enter)s::bool, %(tenant)s::text, %(keys)s::text[], "
    "%(limits)s::float8[]",
}
_COLUMNS = {
    "fg_reserve": f"o.code, {_RESERVATION}, {_BALANCES}, o.holder, o.lease_until_ms, o.clock_ms",
    "fg_close": f"o.code, {_RESERVATION}",
    "fg_claim": "o.holder, o.lease_until_ms, o.clock_ms",
    "fg_queue_step": f"o.code, {_RESERVATION}",
}


@lru_cache(maxsize=64)
def call(function: str, schema_name: str) -> str:
    """The statement calling ``function`` (one of ``FUNCTIONS``) of the ledger in ``schema_name``."""
    return f'SELECT {_COLUMNS[function]} FROM "{schema_name}".{function}({_ARGS[function]}) AS o'


@lru_cache(maxsize=64)
def try_call(function: str, schema_name: str) -> str:
    """The statement calling ``function`` (one of ``FUNCTIONS``) in a batch: its ``fg_try_`` wrapper, which
    returns the error's SQLSTATE, message and detail (NULL: none), then ``call``'s columns."""
    wrapper = function.replace("fg_", "fg_try_", 1)
    columns = f"o.err_state, o.err_message, o.err_detail, {_COLUMNS[function]}"
    return f'SELECT {columns} FROM "{schema_name}".{wrapper}({_ARGS[function]}) AS o'


def reserve_params(
    args: rules.ReserveArgs,
    reservation_id: str,
    limits: Limits,
    books: Mapping[str, Limits],
    now_ms: float | None,
    claim: tuple[str | None, float] = (None, 0.0),
) -> dict[str, Any]:
    """``fg_reserve``'s parameters: ``books`` are ``Ledger.books``, ``limits`` the class's (its TTL), ``claim``
    the run claim's owner (None: none asked) and lease, ms."""
    price = args.price
    return {
        "lock": lock_key(tenant_tag(args.tenant)),
        "now": now_ms,
        "id": reservation_id,
        "tenant": args.tenant,
        "request_id": args.request_id,
        "model_class": args.model_class,
        "run_id": args.run_id,
        "tool_round": args.tool_round,
        "input": args.input_tokens,
        "output": args.max_output_tokens,
        "estimate": float(args.gpu_ms_estimate),
        "price": [price.input_micros_per_token, price.output_micros_per_token, price.gpu_micros_per_ms],
        "ttl_s": float(limits.reservation_ttl_s),
        "keys": list(books),
        "limits": packed_books(books),
        "owner": claim[0],
        "lease_ms": claim[1],
    }


def reserved(row: tuple[Any, ...]) -> tuple[str, Reservation]:
    """``fg_reserve``'s code and reservation, its ``balances`` the binding account (a new one when none is
    stored: a stored one has its ``requests_updated_ms``) and its ``claim`` (None when none was decided)."""
    n, m = len(schema.RESERVATION_FIELDS), len(schema.ACCOUNT_FIELDS)
    account = row[1 + n : 1 + n + m]
    balances = rules.Account() if account[1] is None else rules.Account(*account)
    holder, until_ms, now_ms = row[1 + n + m :]
    claim = None if holder is None else RunClaim(str(holder), float(until_ms), float(now_ms))
    return str(row[0]), replace(schema.reservation(row[1 : 1 + n]), balances=balances, claim=claim)


def _double(text: str) -> float:
    """A double from ``float8send``'s bytes in hex."""
    value: float = struct.unpack(">d", bytes.fromhex(text))[0]
    return value


@dataclass(frozen=True)
class Refused:
    """What a call's refusal is mapped with: the id asked for, the tenant and books a quota refusal names, and
    the amounts and kind of a settlement."""

    reservation_id: str = ""
    tenant: str = ""
    books: Mapping[str, Limits] = field(default_factory=dict)
    billed: Usage | None = None
    kind: str = ""

    def error(self, sqlstate: str | None, detail: str) -> LedgerError | None:
        """The exception for an ``FG`` SQLSTATE and its detail; None for any other error."""
        if sqlstate == "FG001":
            dimension, retry, remaining, key = detail.split(" ", 3)
            left = _double(remaining)
            return QuotaExceeded(
                self.tenant,
                dimension,
                None if retry == "-" else _double(retry),
                getattr(self.books[key], dimension),
                int(left) if dimension in INT_LIMITS else left,
            )
        if sqlstate == "FG002":
            return ReservationNotFound(f"no reservation {self.reservation_id!r}")
        if sqlstate == "FG003":
            return SettlementFrozen(f"automatic settlement is frozen for tenant {detail!r}")
        if sqlstate == "FG004" and self.billed is not None:
            max_output, billed_in, billed_out, billed_gpu = detail.split(" ")
            before = Usage(int(billed_in), int(billed_out), _double(billed_gpu))
            try:
                rules.check_billed(int(max_output), before, self.billed, self.kind)
            except InvalidUsage as exc:
                return exc
            return InvalidUsage(f"{self.kind}: amounts {self.billed} do not fit reservation {self.reservation_id!r}")
        if sqlstate == "FG005":
            return ReservationFinal(f"reservation {self.reservation_id!r} is {detail} already")
        if sqlstate == "FG006":
            return UnknownTenant(f"tenant {detail!r} has no quota configuration")
        return None
