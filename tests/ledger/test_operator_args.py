"""Operator calls refuse bad arguments alike on every backend: ``InvalidUsage`` naming the argument, never
a driver's own error (sqlite3, psycopg, redis-py) or an empty name stored."""

from __future__ import annotations

from typing import Any

import pytest

from fairgate.ledger import InvalidUsage

QUOTAS = {"tenants": {"a": {}}}


@pytest.mark.parametrize(
    ("call", "args", "field"),
    [
        ("account", (5,), "tenant"),
        ("account", ("", "default"), "tenant"),
        ("account", ("a", None), "model_class"),
        ("freeze", ("a", None), "reason"),
        ("freeze", ("", "why"), "tenant"),
        ("freeze", (None, "why"), "tenant"),
        ("freeze", ("a\x00b", "why"), "tenant"),
        ("unfreeze", (None,), "tenant"),
        ("unfreeze", ("",), "tenant"),
    ],
)
async def test_bad_operator_arguments_are_invalid_usage(open_ledger, call: str, args: tuple[Any, ...], field: str):  # type: ignore[no-untyped-def]
    ledger = await open_ledger(QUOTAS)
    with pytest.raises(InvalidUsage, match=field):
        await getattr(ledger, call)(*args)
    assert await ledger.frozen() == {}  # nothing stored


async def test_freeze_takes_any_reason_text(open_ledger):  # type: ignore[no-untyped-def]
    ledger = await open_ledger(QUOTAS)
    await ledger.freeze("a", "")
    await ledger.freeze("a", "billed 12 tokens over; ledger and event log differ")
    assert await ledger.frozen() == {"a": "billed 12 tokens over; ledger and event log differ"}
    await ledger.unfreeze("a")
    assert await ledger.frozen() == {}
