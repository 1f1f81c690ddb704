"""The Redis ledger's limits hashes and TTLs: the scripts read a tenant's limits from a hash named by their
version (written on open, and again whenever a script finds it missing), never run without them, let processes
with different quotas run side by side, and set the tenant's TTLs together only once they have run down."""

from __future__ import annotations

import math
import re
import struct
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from fairgate.ledger import LedgerUnavailable, QuotaExceeded, Quotas, quotas_from_dict
from fairgate.ledger.base import tenant_tag
from fairgate.ledger.config import LIMIT_FIELDS
from fairgate.ledger.redis import TENANT_KEYS, RedisLedger, codec
from tests.ledger.conftest import const

RETENTION_MS = 35 * 86_400_000
REFRESH_AFTER_MS = 60_000  # prelude.lua


def _quotas(max_concurrent: int) -> Quotas:
    return quotas_from_dict(
        {
            "defaults": {
                "requests_per_minute": 600,
                "max_concurrent": max_concurrent,
                "max_queued": 1,
                "reservation_ttl_s": 20,
            },
            "tenants": {"a": {"model_class": {"large": {"max_concurrent": 1, "gpu_seconds": 2}}}},
        }
    )


@pytest.fixture
def redis_ledger(redis_ledgers: Callable[..., Any]) -> Callable[..., Any]:
    """``await redis_ledger(quotas, clock=None)``: a ledger on this test's prefix (one prefix: two calls are two
    processes sharing a ledger)."""
    return redis_ledgers


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[Redis]:
    async with Redis.from_url(redis_url) as redis:
        yield redis


async def _limits_keys(ledger: RedisLedger, client: Redis, tenant: str = "a") -> list[str]:
    pattern = f"{{{ledger.prefix}:{tenant_tag(tenant)}}}:limits:*"
    return sorted([key.decode() async for key in client.scan_iter(match=pattern)])


def test_the_scripts_unpack_the_limits_in_the_order_they_are_packed():
    prelude = (Path(codec.__file__).parent / "scripts" / "prelude.lua").read_text()
    unpack = re.search(r"local function unpack_limits\(packed\)\n(.*?)\nend\n", prelude, re.S)
    assert unpack is not None
    fields = re.findall(r"([a-z_]+) = (?:limit\(([a-r])\)|PERIODS\[([a-r])\])", unpack.group(1))
    assert tuple(name for name, _, _ in fields) == codec.LIMIT_ORDER
    assert [a or b for _, a, b in fields] == list("abcdefghijklmnopqr")  # the values in the order unpacked
    assert re.search(r"LIMITS_FORMAT = '<(d+)'", prelude).group(1) == "d" * len(codec.LIMIT_ORDER)  # type: ignore[union-attr]
    assert sorted(codec.LIMIT_ORDER) == sorted(LIMIT_FIELDS)


async def test_open_writes_each_tenants_limits_hash_with_the_retention_ttl(redis_ledger, client):
    quotas = _quotas(2)
    ledger = await redis_ledger(quotas)
    [key] = await _limits_keys(ledger, client)
    assert 0 < RETENTION_MS - await client.pttl(key) < 600_000
    stored = await client.hgetall(key)
    assert set(stored) == {b"*", b"large", codec.LIMITS_TEXT_FIELD.encode()}
    values = dict(zip(codec.LIMIT_ORDER, struct.unpack(f"<{len(codec.LIMIT_ORDER)}d", stored[b"large"]), strict=True))
    large = quotas.tenant("a").for_model_class("large")
    assert (values["max_concurrent"], values["gpu_seconds"], values["requests_burst"]) == (1.0, 2.0, 600.0)
    assert math.isnan(values["gpu_seconds_total"]) and large.gpu_seconds_total is None  # NaN: no limit
    assert codec.limits_hash(quotas.tenant("a"))[0] in key  # named by its version


async def test_a_lost_limits_hash_is_written_again_and_its_limits_apply(redis_ledger, client, clock):
    ledger = await redis_ledger(_quotas(3), clock)

    async def lose() -> None:
        await client.delete(*await _limits_keys(ledger, client))

    await lose()
    first = await ledger.reserve("a", "r1", 1, 1, 0.0, model_class="large")
    assert len(await _limits_keys(ledger, client)) == 1
    await lose()
    with pytest.raises(QuotaExceeded, match="max_concurrent"):  # the class's limit of 1 applies
        await ledger.reserve("a", "r2", 1, 1, 0.0, model_class="large")
    second, third = [await ledger.reserve("a", f"r{i}", 1, 1, 0.0) for i in (3, 4)]
    await lose()
    assert (await ledger.enqueue(second.id)).queued
    await lose()
    with pytest.raises(QuotaExceeded, match="max_queued"):
        await ledger.enqueue(third.id)
    await lose()
    settled = await ledger.settle(first.id, 1, 1, 0.0, final=True)
    assert settled.status == "settled" and (await ledger.account("a", "large")).concurrent == 0
    clock.advance(30.0)
    await lose()
    expired = await ledger.expire_due(lambda r: const(False))
    assert sorted(r.request_id for r in expired) == ["r3", "r4"]
    assert (await ledger.account("a")).concurrent == 0


async def test_nothing_runs_without_limits(redis_ledger, client, monkeypatch):
    ledger = await redis_ledger(_quotas(2))
    r = await ledger.reserve("a", "r1", 1, 1, 0.0)

    async def cannot_store(tags: Any) -> None:
        return None  # the hash is lost again as soon as it is written

    monkeypatch.setattr(ledger, "_store_limits", cannot_store)
    await client.delete(*await _limits_keys(ledger, client))
    before = await ledger.account("a")
    with pytest.raises(LedgerUnavailable, match="limits"):
        await ledger.reserve("a", "r2", 1, 1, 0.0)
    with pytest.raises(LedgerUnavailable, match="limits"):
        await ledger.settle(r.id, 1, 1, 0.0, final=True)
    with pytest.raises(LedgerUnavailable, match="limits"):
        await ledger.enqueue(r.id)
    assert [x.request_id for x in await ledger.reservations("a")] == ["r1"]
    assert (await ledger.get(r.id)).status == "open" and await ledger.account("a") == before


async def test_processes_with_different_limits_each_apply_their_own(redis_ledger, client):
    one, three = await redis_ledger(_quotas(1)), await redis_ledger(_quotas(3))
    assert len(await _limits_keys(one, client)) == 2  # side by side, neither overwrites the other
    await one.reserve("a", "r1", 1, 1, 0.0)
    with pytest.raises(QuotaExceeded, match="max_concurrent"):
        await one.reserve("a", "r2", 1, 1, 0.0)
    await three.reserve("a", "r2", 1, 1, 0.0)
    await three.reserve("a", "r3", 1, 1, 0.0)
    with pytest.raises(QuotaExceeded, match="max_concurrent"):
        await three.reserve("a", "r4", 1, 1, 0.0)
    assert (await one.account("a")).concurrent == 3
    assert len(await _limits_keys(one, client)) == 2


async def _tenant_ttls(ledger: RedisLedger, client: Redis, tenant: str = "a") -> dict[str, int]:
    tag = f"{{{ledger.prefix}:{tenant_tag(tenant)}}}:"
    keys = [key.decode() async for key in client.scan_iter(match=f"{tag}*")]
    return {key.removeprefix(tag): await client.pttl(key) for key in keys if ":limits:" not in key}


async def test_keys_created_after_the_first_reservation_get_their_ttl(redis_ledger, client):
    ledger = await redis_ledger(_quotas(2))
    r = await ledger.reserve("a", "r1", 1, 1, 0.0)
    await ledger.claim(r.id, "gw-1", 1000.0)
    await ledger.settle(r.id, 1, 1, 0.0, final=True)  # open, hb and claims emptied: deleted
    assert {"open", "hb", "claims"}.isdisjoint(await _tenant_ttls(ledger, client))
    r = await ledger.reserve("a", "r2", 1, 1, 0.0, run_id="run-1")  # open again, runs for the first time
    await ledger.claim(r.id, "gw-1", 1000.0)  # hb, claims again
    await ledger.freeze("a", "check")
    await ledger.unfreeze("a")
    await ledger.freeze("a", "again")  # frozen again
    ttls = await _tenant_ttls(ledger, client)
    assert set(ttls) == set(TENANT_KEYS)
    assert all(RETENTION_MS - 600_000 < ttl <= RETENTION_MS for ttl in ttls.values()), ttls


async def test_ttls_are_set_together_once_run_down_and_not_on_every_write(redis_ledger, client):
    ledger = await redis_ledger(_quotas(3))
    await ledger.reserve("a", "r1", 1, 1, 0.0)
    tag = f"{{{ledger.prefix}:{tenant_tag('a')}}}:"
    # Within a minute of the retention: a write leaves the TTLs as they are (no PEXPIRE per key and call).
    await client.pexpire(f"{tag}events", RETENTION_MS - 30_000)
    await ledger.reserve("a", "r2", 1, 1, 0.0)
    assert await client.pttl(f"{tag}events") <= RETENTION_MS - 30_000
    # Run down by more than a minute: the next write sets every key's TTL afresh.
    for name in TENANT_KEYS:
        await client.pexpire(f"{tag}{name}", RETENTION_MS - 2 * REFRESH_AFTER_MS)
    await ledger.reserve("a", "r3", 1, 1, 0.0)
    ttls = await _tenant_ttls(ledger, client)
    assert all(ttl > RETENTION_MS - REFRESH_AFTER_MS for ttl in ttls.values()), ttls


async def test_the_scripts_write_numbers_as_17_significant_digits(client):
    values = [0.0, -0.0, 1.0, -1.0, 12.0, 0.1, 1 / 3, 2.5e-9, 1e14, 999_999_999_999_999.0, 1e15, -1e15, 1e17, 1e300]
    values += [1_700_000_000_123.0, 1_700_000_000_123.25, 2.0**53, -(2.0**52) - 0.5, 123456789.000001]
    fmt = re.search(
        r"(local function fmt\(x\).*?\nend)",
        (Path(codec.__file__).parent / "scripts" / "prelude.lua").read_text(),
        re.S,
    )
    assert fmt is not None
    script = fmt.group(1) + "\nlocal out = {}\nfor i, v in ipairs(ARGV) do out[i] = fmt(tonumber(v)) end\nreturn out"
    written = [x.decode() for x in await client.eval(script, 0, *(repr(v) for v in values))]
    assert written == [f"{v:.17g}" for v in values]
