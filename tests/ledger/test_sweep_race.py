"""The sweep reads the reservations due, then expires them one by one: a settlement landing in between must
be billed by the expiry, on every backend (the expiry bills what the reservation holds when it is closed,
not what the sweep read)."""

from __future__ import annotations

from fairgate.ledger import Usage

QUOTAS = {"defaults": {"reservation_ttl_s": 1}, "tenants": {"a": {}}}


async def test_an_expiry_bills_a_settlement_made_after_the_sweep_read_the_reservation(open_ledger, clock):  # type: ignore[no-untyped-def]
    ledger = await open_ledger(QUOTAS, clock)
    placed = await ledger.reserve("a", "r-1", 10, 100, 5.0)
    await ledger.settle(placed.id, 10, 5, 1.0)
    clock.advance(2.0)
    [due] = await ledger._due()  # what the sweep read
    await ledger.settle(placed.id, 10, 58, 9.0)  # the request was still streaming: a settlement lands
    expired = await ledger._expire(due)
    assert expired is not None and expired.status == "expired" and expired.billed == Usage(10, 58, 9.0)
    assert (await ledger.get(placed.id)).billed == Usage(10, 58, 9.0)
    events = await ledger.events("a")
    assert sum(e.output_tokens for e in events) == 58
