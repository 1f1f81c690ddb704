"""How the Redis ledger's values are written and read: numbers as strings Lua's ``tonumber`` reads back
exactly, reservations, events and accounts as the JSON the scripts store (numbers as ``%.17g`` strings)."""

from __future__ import annotations

import json
from typing import Any

from fairgate.ledger import rules
from fairgate.ledger.config import LIMIT_FIELDS, Limits
from fairgate.ledger.model import Event, Reservation, reservation_from_record

# The limits sent to the scripts, as numbers (the bursts are sent as ``Limits.burst()``).
_LIMIT_NAMES = tuple(name for name in LIMIT_FIELDS if not name.endswith("_burst"))
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
    spec = {name: number(getattr(limits, name)) for name in _LIMIT_NAMES if getattr(limits, name) is not None}
    for dimension in ("requests", "input_tokens", "output_tokens"):
        burst = limits.burst(dimension)
        if burst is not None:
            spec[f"{dimension}_burst"] = number(burst)
    return spec


def reservation(raw: bytes | str, balances: rules.Account | None = None) -> Reservation:
    """A reservation from the JSON ``reserve.lua`` / ``close.lua`` store (flags as ``"1"`` / ``"0"``), with
    ``balances`` (``reserve``'s)."""
    return reservation_from_record(json.loads(raw), to_int, lambda value: value == "1", balances)


def event(tenant: str, raw: bytes | str) -> Event:
    """An event from a member of the tenant's event log (``prelude.lua``'s ``add_event``)."""
    seq, kind, rid, requests, input_tokens, output_tokens, gpu_ms, overage, at_ms = json.loads(raw)
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
