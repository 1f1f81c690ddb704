"""How the Redis ledger's values are written and read: numbers as strings Lua's ``tonumber`` reads back
exactly, reservations, events and accounts as the JSON the scripts store (numbers as ``%.17g`` strings), and a
tenant's limits as the hash the scripts read them from."""

from __future__ import annotations

import hashlib
import json
import math
import struct
from typing import Any

from fairgate.ledger import rules
from fairgate.ledger.config import LIMIT_FIELDS, PACKED_LIMITS, TENANT_ACCOUNT, Limits, TenantQuota, packed_limit_values
from fairgate.ledger.model import Event, Reservation, reservation_from_record
from fairgate.ledger.periods import PERIOD_CODES

# The limits sent to the scripts, as numbers (the bursts are sent as ``Limits.burst()``).
_LIMIT_NAMES = tuple(name for name in LIMIT_FIELDS if not name.endswith("_burst"))
# The order of the limits packed in a limits hash's values: the order prelude.lua's unpack_limits names them in.
LIMIT_ORDER = PACKED_LIMITS
# Bumped when the hash's layout changes: it is part of what names a hash (``limits_hash``), so a process with
# another layout never reads this one.
LIMITS_LAYOUT = 2
LIMITS_TEXT_FIELD = "\njson"  # no model class contains a newline (``model.check_name``)
# Limits that are whole numbers: a QuotaExceeded on them reports an int ``remaining``.
INT_LIMITS = frozenset(
    {"max_tokens_per_request", "max_concurrent", "max_queued", "max_model_calls", "max_tool_rounds", "max_tokens"}
)


def number(value: float | int) -> str:
    """A number as a string that Lua's ``tonumber`` reads back exactly."""
    return repr(float(value)) if isinstance(value, float) else str(int(value))


def to_int(text: str) -> int:
    """An integer the scripts stored (``%.17g``: ``"12"``, or ``"1e+20"`` for a large one)."""
    return int(text) if text.lstrip("-").isdigit() else int(float(text))


def limits_spec(limits: Limits) -> dict[str, str]:
    """``limits`` as the scripts take them: name -> number string; absent: no limit; ``*_burst`` the bucket's
    capacity (``Limits.burst``)."""
    values = {name: _limit_value(limits, name) for name in _LIMIT_NAMES}
    spec = {name: number(value) for name, value in values.items() if value is not None}
    for dimension in ("requests", "input_tokens", "output_tokens"):
        burst = limits.burst(dimension)
        if burst is not None:
            spec[f"{dimension}_burst"] = number(burst)
    return spec


def _limit_value(limits: Limits, name: str) -> float | int | None:
    """A limit as a number (``spend_period`` as its code)."""
    value = getattr(limits, name)
    return PERIOD_CODES[value] if name == "spend_period" else value


def packed_limits(limits: Limits) -> bytes:
    """``limits`` in ``LIMIT_ORDER`` as little-endian doubles, NaN where there is no limit (a ``*_burst`` is
    ``Limits.burst``, the bucket's capacity): what ``prelude.lua``'s ``unpack_limits`` reads back exactly."""
    values = [math.nan if value is None else value for value in packed_limit_values(limits)]
    return struct.pack(f"<{len(values)}d", *values)


def limits_hash(quota: TenantQuota) -> tuple[str, dict[str, bytes | str]]:
    """The hash the scripts read ``quota``'s limits from: (its version, its fields). Fields: ``*`` (the tenant's
    own limits) and one per model class with a table of its own, each ``packed_limits``; and
    ``LIMITS_TEXT_FIELD``, the same as JSON text for a reader (never read by the scripts). The version (16 hex
    digits) is a hash of that text and ``LIMITS_LAYOUT``: equal limits, equal version; any change, another."""
    spec = {
        "layout": LIMITS_LAYOUT,
        "order": LIMIT_ORDER,
        "base": limits_spec(quota.limits),
        "classes": {mc: limits_spec(lim) for mc, lim in quota.by_model_class.items()},
    }
    text = json.dumps(spec, sort_keys=True)
    fields: dict[str, bytes | str] = {TENANT_ACCOUNT: packed_limits(quota.limits)}
    fields.update({mc: packed_limits(lim) for mc, lim in quota.by_model_class.items()})
    fields[LIMITS_TEXT_FIELD] = text
    return hashlib.sha256(text.encode()).hexdigest()[:16], fields


def reservation(raw: bytes | str, balances: rules.Account | None = None) -> Reservation:
    """A reservation from the JSON ``reserve.lua`` / ``close.lua`` store (flags as ``"1"`` / ``"0"``), with
    ``balances`` (``reserve``'s)."""
    return reservation_from_record(json.loads(raw), to_int, lambda value: value == "1", balances)


def event(tenant: str, raw: bytes | str) -> Event:
    """An event from a member of the tenant's event log (``prelude.lua``'s ``add_event``)."""
    # A member written before spend was booked has no tenth value: it cost nothing.
    seq, kind, rid, requests, input_tokens, output_tokens, gpu_ms, overage, at_ms, *spend = json.loads(raw)
    return Event(
        seq=to_int(seq),
        tenant=tenant,
        reservation_id=rid,
        kind=kind,
        requests=to_int(requests),
        input_tokens=to_int(input_tokens),
        output_tokens=to_int(output_tokens),
        gpu_ms=float(gpu_ms),
        overage_gpu_ms=float(overage),
        at_ms=float(at_ms),
        spend_micros=float(spend[0]) if spend else 0.0,
    )


def account(raw: bytes | str | None) -> rules.Account:
    """An account from ``prelude.lua``'s ``save_account`` JSON (None: never written, a fresh account)."""
    if raw is None:
        return rules.Account()
    stored = json.loads(raw)
    values: dict[str, Any] = {name: float(text) for name, text in stored.items()}
    values["concurrent"] = to_int(stored.get("concurrent", "0"))
    values["queued"] = to_int(stored.get("queued", "0"))
    return rules.Account(**values)


def text(value: bytes | str) -> str:
    """A reply as text (the client decodes replies; redis-py's types allow bytes)."""
    return value.decode() if isinstance(value, bytes) else value
