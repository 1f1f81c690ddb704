"""Redis-only properties of the ledger: TTLs on every key, one hash slot per tenant, connection errors,
URL validation, the server clock, atomicity across clients, and exact agreement with the SQL backends
(the Lua scripts must do the arithmetic of ``rules.py`` bit for bit)."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
import uuid
import zlib
from collections.abc import Callable
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.crc import key_slot

from fairgate.ledger import LedgerError, LedgerUnavailable, QuotaExceeded, Quotas, Usage, connect, quotas_from_dict
from fairgate.ledger.base import tenant_tag
from fairgate.ledger.redis import TENANT_KEYS, RedisLedger
from tests.ledger.conftest import FakeClock, const

QUOTAS = quotas_from_dict(
    {
        "defaults": {
            "requests_per_minute": 120,
            "requests_burst": 6,
            "input_tokens_per_minute": 3000,
            "input_tokens_burst": 1500,
            "output_tokens_per_minute": 3000,
            "output_tokens_burst": 1200,
            "max_tokens_per_request": 1200,
            "max_concurrent": 4,
            "gpu_seconds": 5,
            "gpu_window_s": 120,
            "gpu_seconds_total": 30,
            "max_model_calls": 4,
            "max_tool_rounds": 2,
            "max_tokens": 3000,
            "reservation_ttl_s": 20,
        },
        "tenants": {"a": {}, "b": {"model_class": {"large": {"max_concurrent": 1, "gpu_seconds": 2}}}},
    }
)


@pytest.fixture
def redis_ledger(redis_ledgers: Callable[..., Any]) -> Callable[..., Any]:
    """``await redis_ledger(clock=None, prefix=None, quotas=QUOTAS, query="")``: a ledger on a fresh prefix (more
    URL parameters in ``query``); keys dropped after."""

    def make(
        clock: Callable[[], float] | None = None, prefix: str | None = None, quotas: Quotas = QUOTAS, query: str = ""
    ) -> Any:
        return redis_ledgers(quotas, clock, prefix, query)

    return make


async def _keys_of(ledger: RedisLedger, client: Redis) -> list[str]:
    keys = [k async for k in client.scan_iter(match=f"{{{ledger.prefix}:*")]
    return keys + [k async for k in client.scan_iter(match=f"{ledger.prefix}:*")]


async def _mixed_operations(ledger: RedisLedger, clock: FakeClock) -> None:
    r1 = await ledger.reserve("a", "r1", 100, 200, 500.0, run_id="run-1", tool_round=True)
    r2 = await ledger.reserve("a", "r2", 100, 200, 500.0)
    r3 = await ledger.reserve("b", "r3", 10, 20, 50.0, model_class="large")
    await ledger.reserve("a", "r1", 100, 200, 500.0, run_id="run-1", tool_round=True)  # idempotent retry
    await ledger.settle(r1.id, 100, 50, 300.0)
    await ledger.heartbeat(r2.id)
    await ledger.settle(r1.id, 100, 80, 400.0, final=True)
    await ledger.cancel(r3.id, Usage(10, 5, 10.0))
    for failing in (
        ledger.reserve("b", "big", 5000, 1, 0.0),  # quota: nothing written
        ledger.settle(r2.id, 100, 999, 1.0),  # invalid: nothing written
        ledger.settle(r1.id, 100, 1, 1.0, final=True),
    ):  # final already
        with pytest.raises(LedgerError):
            await failing
    await ledger.freeze("b", "reconciliation")
    await ledger.unfreeze("b")
    await ledger.freeze("a", "reconciliation")
    await ledger.unfreeze("a")
    clock.now_ms += 30_000
    await ledger.expire_due(lambda r: const(False))
    await ledger.usage("a", 3600)


async def test_every_key_has_a_ttl_after_mixed_operations(redis_ledger, redis_url, clock):
    ledger = await redis_ledger(clock)
    await _mixed_operations(ledger, clock)
    await ledger.freeze("b", "left frozen")  # the frozen key exists at the end too
    await ledger.claim((await ledger.reserve("a", "still-open", 1, 1, 0.0)).id, "gw-1", 1000.0)  # open, hb, claims
    await ledger.add_charges("emu", {"a": (1.0, 1, 1)})  # the shared counters and occupancy (an outside tester:
    await ledger.share_occupancy("gw-1", {"emu-0": (1.0, 0.0)}, 60_000.0)  # no TTL on either)
    async with Redis.from_url(redis_url, decode_responses=True) as client:
        keys = await _keys_of(ledger, client)
        suffixes = {k.rsplit(":", 1)[1] for k in keys}
        assert set(TENANT_KEYS) <= suffixes
        assert f"{ledger.prefix}:tenants" in keys
        assert any(":charges" in k for k in keys) and any(":occupancy" in k for k in keys), keys
        ttls = {k: await client.pttl(k) for k in keys}
    without = {k: ttl for k, ttl in ttls.items() if ttl <= 0}
    assert not without, f"keys left without a TTL: {without}"
    # The TTL is the retention (35 days by default), refreshed on write; a process's occupancy, its staleness.
    kept = {k: ttl for k, ttl in ttls.items() if not k.endswith(":gw-1")}
    assert all(35 * 86_400_000 - 600_000 < ttl <= 35 * 86_400_000 for ttl in kept.values()), kept


async def test_retention_days_from_the_url(redis_ledger, redis_url):
    ledger = await redis_ledger(query="&retention_days=2")
    r = await ledger.reserve("a", "x", 1, 1, 0.0)
    await ledger.heartbeat(r.id)
    async with Redis.from_url(redis_url, decode_responses=True) as client:
        ttls = [await client.pttl(k) for k in await _keys_of(ledger, client)]
    assert ttls and all(2 * 86_400_000 - 600_000 < ttl <= 2 * 86_400_000 for ttl in ttls)


async def test_all_keys_of_a_tenant_share_one_hash_slot(redis_ledger, redis_url, clock):
    ledger = await redis_ledger(clock)
    await _mixed_operations(ledger, clock)
    r = await ledger.reserve("b", "open-one", 1, 1, 0.0)
    await ledger.heartbeat(r.id)
    assert r.id.startswith(tenant_tag("b") + "-")
    async with Redis.from_url(redis_url, decode_responses=True) as client:
        keys = await _keys_of(ledger, client)
    for tenant in ("a", "b"):
        tag = f"{{{ledger.prefix}:{tenant_tag(tenant)}}}"
        mine = [k for k in keys if k.startswith(tag)]
        assert len(mine) >= 7
        assert {key_slot(k.encode()) for k in mine} == {key_slot(tag.encode())}
    # Every key is either a tenant's (in its slot) or the one registry key.
    assert [k for k in keys if not k.startswith(f"{{{ledger.prefix}:")] == [f"{ledger.prefix}:tenants"]


async def test_unreachable_server_raises_ledger_unavailable():
    started = time.monotonic()
    with pytest.raises(LedgerUnavailable):
        await connect("redis://127.0.0.1:1/0?prefix=fgt_unreachable", QUOTAS)
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    "query", ["prefix=a:b", "prefix=x*", "prefix=", "prefix={t}", "retention_days=0", "retention_days=soon"]
)
async def test_bad_url_parameters_are_rejected(redis_url, query):
    with pytest.raises(ValueError):
        await connect(f"{redis_url}?{query}", QUOTAS)


async def test_server_clock_is_used_without_a_clock(redis_ledger):
    ledger = await redis_ledger()
    before = time.time() * 1000.0
    r = await ledger.reserve("a", "t", 10, 10, 1.0)
    after = time.time() * 1000.0
    assert before - 5_000 < r.created_ms < after + 5_000  # the server's TIME, same machine
    assert r.expires_at_ms == r.created_ms + 20_000
    done = await ledger.settle(r.id, 10, 5, 1.0, final=True)
    assert done.final_ms is not None and done.final_ms >= r.created_ms
    assert [e.kind for e in await ledger.events("a")] == ["reserve", "settle_final"]


async def test_two_clients_never_both_take_the_last_slot(redis_ledger, clock):
    first, second = await redis_ledger(clock), await redis_ledger(clock)  # separate connection pools
    calls = [(first if i % 2 else second).reserve("a", f"c{i}", 1, 1, 0.0) for i in range(30)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert sum(not isinstance(r, Exception) for r in results) == 4  # max_concurrent
    assert all(isinstance(r, QuotaExceeded) for r in results if isinstance(r, Exception))
    assert (await first.account("a")).concurrent == 4


async def test_events_of_all_tenants_keep_each_tenants_order(redis_ledger, clock):
    ledger = await redis_ledger(clock)
    ra = await ledger.reserve("a", "x", 1, 1, 0.0)
    clock.now_ms += 1000
    rb = await ledger.reserve("b", "x", 1, 1, 0.0)
    clock.now_ms -= 5000  # a clock behind: a's settlement is logged "before" both reserves
    await ledger.settle(ra.id, 1, 1, 0.0, final=True)
    events = await ledger.events()
    assert [(e.tenant, e.kind) for e in events if e.tenant == "a"] == [("a", "reserve"), ("a", "settle_final")]
    assert {e.reservation_id for e in events} == {ra.id, rb.id} and len(events) == 3


# --- the Lua scripts against rules.py, through the SQLite backend --------------------------------
# Tenant "a" is bound by its buckets (requests, tokens, GPU budgets), "b" by concurrency and runs.
DIFF_QUOTAS = quotas_from_dict(
    {
        "defaults": {
            "requests_per_minute": 8,
            "requests_burst": 3,
            "input_tokens_per_minute": 900,
            "input_tokens_burst": 1300,
            "output_tokens_per_minute": 700,
            "output_tokens_burst": 1200,
            "max_tokens_per_request": 1200,
            "max_concurrent": 20,
            "gpu_seconds": 6.5,
            "gpu_window_s": 90,
            "gpu_seconds_total": 22,
            "max_model_calls": 3,
            "max_tool_rounds": 2,
            "max_tokens": 1500,
            "reservation_ttl_s": 20,
        },
        "tenants": {
            "a": {},
            "b": {
                "limits": {
                    "requests_per_minute": 600,
                    "requests_burst": 50,
                    "max_concurrent": 3,
                    "input_tokens_per_minute": 60000,
                    "output_tokens_per_minute": 60000,
                    "gpu_seconds": 40,
                    "gpu_seconds_total": 400,
                },
                "model_class": {"large": {"max_concurrent": 1, "gpu_seconds": 2}},
            },
        },
    }
)


def _tie_groups(events: list[Any]) -> list[Any]:
    """Consecutive events at the same ``at_ms`` as sorted groups (one sweep expires ties in any order)."""
    groups: list[list[Any]] = []
    for e in events:
        if groups and groups[-1][0][-1] == e[-1]:
            groups[-1].append(e)
        else:
            groups.append([e])
    return [sorted(g) for g in groups]


def _event_rows(events: list[Any], key_of: dict[str, Any]) -> list[Any]:
    """The events with reservation ids replaced by their (tenant, request id), in tie groups."""
    return _tie_groups(
        [
            (
                key_of[e.reservation_id],
                e.kind,
                e.requests,
                e.input_tokens,
                e.output_tokens,
                e.gpu_ms,
                e.overage_gpu_ms,
                e.at_ms,
            )
            for e in events
        ]
    )


def _normal(r: Any) -> Any:
    return (
        r.tenant,
        r.request_id,
        r.model_class,
        r.run_id,
        r.tool_round,
        r.input_tokens,
        r.max_output_tokens,
        r.gpu_ms_estimate,
        r.status,
        r.billed,
        r.overage_gpu_ms,
        r.created_ms,
        r.expires_at_ms,
        r.final_ms,
    )


def _outcome(result: Any) -> Any:
    if isinstance(result, QuotaExceeded):
        return ("QuotaExceeded", result.dimension, result.retry_after_s, result.limit, result.remaining)
    if isinstance(result, BaseException):
        return (type(result).__name__, re.sub(r"[0-9a-f]{16}-[0-9a-f]{32}", "<id>", str(result)))
    if isinstance(result, list):
        return sorted(_normal(r) for r in result)
    return None if result is None else _normal(result)


@pytest.mark.parametrize("seed", [20240601, 7, 11])
async def test_same_operations_give_identical_results_on_sqlite_and_redis(redis_ledger, tmp_path, seed, clock):
    ledgers = {
        "redis": await redis_ledger(clock, quotas=DIFF_QUOTAS),
        "sqlite": await connect(f"sqlite:///{tmp_path}/diff.db", DIFF_QUOTAS, clock),
    }
    ids: dict[str, dict[tuple[str, str], str]] = {name: {} for name in ledgers}
    rng = random.Random(seed)
    try:
        for step in range(500):
            clock.now_ms += rng.uniform(-2_000, 4_000) if rng.random() < 0.05 else rng.uniform(0, 4_000)
            roll = rng.random()
            known = sorted(ids["sqlite"])
            outcomes = {}
            if roll < 0.45 or not known:
                tenant = rng.choice(("a", "b"))
                request_id = f"q{rng.randrange(300)}"
                h = zlib.crc32(f"{tenant}/{request_id}".encode())
                args = (tenant, request_id, h % 700, (h >> 10) % 600, float((h >> 20) % 2000) + 0.1 * (h % 7))
                if rng.random() < 0.1:
                    args = (tenant, request_id, args[2] + 1, args[3], args[4])  # an IdempotencyConflict
                kwargs = {
                    "model_class": "large" if h % 5 == 0 else "default",
                    "run_id": None if h % 3 == 0 else f"run-{h % 41}",
                    "tool_round": bool(h % 2),
                }
                for name, ledger in ledgers.items():
                    try:
                        r = await ledger.reserve(*args, **kwargs)
                        ids[name][(r.tenant, r.request_id)] = r.id
                        outcomes[name] = _outcome(r)
                    except LedgerError as exc:
                        outcomes[name] = _outcome(exc)
            elif roll < 0.9:
                key = rng.choice(known)
                current = await ledgers["sqlite"].get(ids["sqlite"][key])
                grow = rng.random() < 0.9
                amounts = (
                    current.billed.input_tokens + (rng.randrange(50) if grow else -1),
                    min(
                        current.max_output_tokens + (1 if rng.random() < 0.05 else 0),
                        current.billed.output_tokens + rng.randrange(80),
                    ),
                    current.billed.gpu_ms + rng.uniform(0, 1500),
                )
                final = rng.random() < 0.5
                use_cancel = rng.random() < 0.3
                for name, ledger in ledgers.items():
                    rid = ids[name][key]
                    try:
                        if use_cancel:
                            outcomes[name] = _outcome(await ledger.cancel(rid, Usage(*amounts)))
                        else:
                            outcomes[name] = _outcome(await ledger.settle(rid, *amounts, final=final))
                    except LedgerError as exc:
                        outcomes[name] = _outcome(exc)
            elif roll < 0.95:
                alive = {k for k in known if zlib.crc32(f"{k}{step}".encode()) % 3 == 0}
                for name, ledger in ledgers.items():
                    outcomes[name] = _outcome(
                        await ledger.expire_due(lambda r, alive=alive: const((r.tenant, r.request_id) in alive))
                    )
            elif roll < 0.975:
                key = rng.choice(known)
                for name, ledger in ledgers.items():
                    await ledger.heartbeat(ids[name][key])
                    outcomes[name] = _outcome(await ledger.expire_due())
            else:
                tenant, freeze = rng.choice(("a", "b")), rng.random() < 0.5
                for name, ledger in ledgers.items():
                    await (ledger.freeze(tenant, "diff") if freeze else ledger.unfreeze(tenant))
                    outcomes[name] = await ledger.frozen()
            assert outcomes["redis"] == outcomes["sqlite"], f"step {step}"

        for tenant in ("a", "b"):
            redis_events, sql_events = [await ledgers[n].events(tenant) for n in ("redis", "sqlite")]
            back = {name: {rid: key for key, rid in ids[name].items()} for name in ids}
            assert _event_rows(redis_events, back["redis"]) == _event_rows(sql_events, back["sqlite"])
            usage = [await ledgers[n].usage(tenant, 600) for n in ("redis", "sqlite")]
            assert usage[0] == usage[1]
            for model_class in ("default", "large"):
                accounts = [await ledgers[n].account(tenant, model_class) for n in ("redis", "sqlite")]
                assert accounts[0] == accounts[1]
        assert _outcome(await ledgers["redis"].reservations()) == _outcome(await ledgers["sqlite"].reservations())
        statuses = {r.status for r in await ledgers["sqlite"].reservations()}
        assert {"settled", "cancelled", "expired"} <= statuses, "the sequence exercised too little"
    finally:
        await ledgers["sqlite"].close()


async def test_a_cluster_ledger_puts_each_tenant_on_one_node_and_the_tenants_on_every_node(redis_cluster_url):
    from redis.asyncio import RedisCluster

    tenants = [f"t{i}" for i in range(12)]
    quotas = quotas_from_dict({"defaults": {"max_concurrent": 4}, "tenants": {t: {} for t in tenants}})
    prefix = f"fgc_{uuid.uuid4().hex[:10]}"
    ledger = await connect(f"{redis_cluster_url}&prefix={prefix}", quotas)
    cluster = RedisCluster.from_url(redis_cluster_url.split("?")[0], decode_responses=True)
    try:
        for tenant in tenants:
            r = await ledger.reserve(tenant, f"{tenant}-1", 10, 5, 1.0)
            await ledger.settle(r.id, 10, 5, 1.0, final=True)
        nodes_of: dict[str, set[int]] = {t: set() for t in tenants}
        await cluster.initialize()  # (learns the nodes)
        for node in cluster.get_primaries():
            async with Redis(host=node.host, port=node.port, decode_responses=True) as client:
                async for key in client.scan_iter(match=f"{{{prefix}:*", count=1000):
                    tag = key.split(":")[1].rstrip("}")
                    nodes_of[next(t for t in tenants if tenant_tag(t) == tag)].add(node.port)
        # Every tenant's keys sit on one node (its scripts touch one hash slot); the tenants use every node.
        assert all(len(ports) == 1 for ports in nodes_of.values()), nodes_of
        assert len({port for ports in nodes_of.values() for port in ports}) == 3, nodes_of
        assert [e.kind for e in await ledger.events("t0")] == ["reserve", "settle_final"]
    finally:
        await ledger.drop_keys()
        await ledger.close()
        await cluster.aclose()


async def test_the_scripts_run_as_functions_and_a_lost_library_is_loaded_again(redis_ledger, redis_url, clock):
    """A server with functions runs the scripts from one library (FCALL); one that lost the library (restarted
    without persistence, flushed) gets it again on the first call that misses it, and the call goes through."""
    ledger = await redis_ledger(clock)
    name = ledger._scripts.library_name
    assert name is not None and name.startswith("fairgate_")
    async with Redis.from_url(redis_url, decode_responses=True) as client:
        assert await _libraries(client, name) == [name]
        r = await ledger.reserve("a", "before", 10, 5, 1.0)
        await client.function_delete(name)
        claim = await ledger.claim(r.id, "gw-1", 1000.0)
        assert claim.held_by("gw-1")
        assert await _libraries(client, name) == [name]
    await ledger.settle(r.id, 10, 5, 1.0, final=True)
    assert [e.kind for e in await ledger.events("a")] == ["reserve", "settle_final"]
    assert ledger._scripts.library_name == name


async def test_an_account_written_by_another_hand_is_read_as_stored(redis_ledger, redis_url, clock):
    """The library keeps the last account it wrote, to copy rather than decode it when it reads that very text
    back: any other text in the hash (another version's scripts, an operator) is decoded."""
    ledger = await redis_ledger(clock)
    first = await ledger.reserve("a", "r1", 10, 5, 1.0)
    key = ledger._keys.tenant(tenant_tag("a"))[TENANT_KEYS.index("accounts")]
    async with Redis.from_url(redis_url, decode_responses=True) as client:
        raw = await client.hget(key, "*")
        stored = json.loads(raw)
        assert stored["concurrent"] == "1"
        await client.hset(key, "*", json.dumps(dict(stored, concurrent="4")))  # max_concurrent: 4
        with pytest.raises(QuotaExceeded) as refused:
            await ledger.reserve("a", "r2", 10, 5, 1.0)
        assert refused.value.dimension == "max_concurrent"
        await client.hset(key, "*", raw)  # the text the library wrote, back again
    second = await ledger.reserve("a", "r3", 10, 5, 1.0)
    assert second.balances is not None and second.balances.concurrent == 2
    await ledger.settle(first.id, 10, 5, 1.0, final=True)
    assert (await ledger.account("a")).concurrent == 1


async def test_a_reservation_written_by_another_hand_is_read_as_stored(redis_ledger, redis_url, clock):
    """The library keeps the open reservations it wrote, to take rather than decode one when a settlement reads
    that very text back: any other text (another version's scripts, an operator) is decoded."""
    ledger = await redis_ledger(clock)
    r = await ledger.reserve("a", "r1", 10, 5, 1.0)
    key = ledger._keys.tenant(tenant_tag("a"))[TENANT_KEYS.index("res")]
    async with Redis.from_url(redis_url, decode_responses=True) as client:
        stored = json.loads(await client.hget(key, r.id))
        await client.hset(key, r.id, json.dumps(dict(stored, max_output_tokens="50")))
    partial = await ledger.settle(r.id, 10, 20, 1.0)  # above the 5 reserved, within the 50 stored
    assert partial.max_output_tokens == 50 and partial.billed.output_tokens == 20
    done = await ledger.settle(r.id, 10, 30, 1.0, final=True)  # the partial settlement's record, kept
    assert done.status == "settled" and done.billed.output_tokens == 30


async def test_a_reservation_is_due_at_its_fractional_expiry_and_not_before(redis_ledger, redis_url, clock):
    """OPEN scores a reservation by its expiry rounded up to a whole ms; the sweep still takes it exactly when
    the clock reaches expires_at_ms, and one scored with the fraction itself (other versions) as well."""
    clock.now_ms = 1_700_000_000_000.25
    ledger = await redis_ledger(clock)
    r = await ledger.reserve("a", "r1", 10, 5, 1.0)
    assert r.expires_at_ms == 1_700_000_020_000.25
    old = await ledger.reserve("a", "r2", 10, 5, 1.0)
    key = ledger._keys.tenant(tenant_tag("a"))[TENANT_KEYS.index("open")]
    async with Redis.from_url(redis_url, decode_responses=True) as client:
        assert await client.zscore(key, r.id) == 1_700_000_020_001.0
        await client.zadd(key, {old.id: old.expires_at_ms})
    clock.now_ms = r.expires_at_ms - 0.125
    assert await ledger.expire_due(lambda r: const(False)) == []
    clock.now_ms = r.expires_at_ms
    assert sorted(e.id for e in await ledger.expire_due(lambda r: const(False))) == sorted([r.id, old.id])


async def test_a_cluster_ledger_runs_the_library_on_every_primary(redis_cluster_url):
    from redis.asyncio import RedisCluster

    prefix = f"fgc_{uuid.uuid4().hex[:10]}"
    tenants = [f"t{i}" for i in range(6)]
    quotas = quotas_from_dict({"defaults": {"max_concurrent": 4}, "tenants": {t: {} for t in tenants}})
    ledger = await connect(f"{redis_cluster_url}&prefix={prefix}", quotas)
    cluster = RedisCluster.from_url(redis_cluster_url.split("?")[0], decode_responses=True)
    try:
        assert isinstance(ledger, RedisLedger)
        name = ledger._scripts.library_name
        assert name is not None
        await cluster.initialize()
        for node in cluster.get_primaries():
            async with Redis(host=node.host, port=node.port, decode_responses=True) as client:
                assert await _libraries(client, name) == [name]
        for tenant in tenants:
            r = await ledger.reserve(tenant, f"{tenant}-1", 10, 5, 1.0)
            await ledger.settle(r.id, 10, 5, 1.0, final=True)
        assert [e.kind for e in await ledger.events("t0")] == ["reserve", "settle_final"]
    finally:
        await ledger.drop_keys()
        await ledger.close()
        await cluster.aclose()


async def _libraries(client: Redis, name: str) -> list[str]:
    """The names of the server's function libraries matching ``name`` (FUNCTION LIST: a flat key-value list
    per library, or a map)."""
    entries = await client.function_list(library=name)
    found = []
    for entry in entries:
        fields = entry if isinstance(entry, dict) else dict(zip(entry[::2], entry[1::2], strict=True))
        found.append(fields["library_name"])
    return found


async def test_a_cluster_ledger_takes_more_calls_at_once_than_a_node_has_connections(redis_cluster_url):
    # redis-py's cluster client fails a call past a node's max_connections at once, where the single server's pool
    # waits: an outside tester's 100 calls at once on a healthy cluster failed 36 (``store.CLUSTER_CALLS_MAX``).
    from fairgate.ledger.redis.store import CLUSTER_CALLS_MAX

    prefix = f"fgc_{uuid.uuid4().hex[:10]}"
    quotas = quotas_from_dict({"defaults": {"max_concurrent": 1000}, "tenants": {"wide": {}}})
    ledger = await connect(f"{redis_cluster_url}&prefix={prefix}", quotas)
    try:
        calls = 3 * CLUSTER_CALLS_MAX
        opened = await asyncio.gather(
            *(ledger.reserve("wide", f"at-once-{i}", 10, 5, 1.0) for i in range(calls)), return_exceptions=True
        )
        failed = [r for r in opened if isinstance(r, BaseException)]
        assert failed == [] and len({r.id for r in opened}) == calls
        assert (await ledger.account("wide")).concurrent == calls
    finally:
        await ledger.drop_keys()
        await ledger.close()


async def test_a_cluster_no_node_answers_is_an_unavailable_ledger(tmp_path):
    # redis-py 8's RedisClusterUnreachableError is no RedisError: an outside tester's cluster outage escaped as it,
    # a gateway answered 500 and its liveness sweep died.
    from fairgate.harness.redis import redis_cluster

    quotas = quotas_from_dict({"tenants": {"t": {}}})
    with redis_cluster(tmp_path / "cluster") as nodes:
        url = f"redis://127.0.0.1:{nodes[0].port}/0?cluster=true&timeout_s=1&prefix=fgc_{uuid.uuid4().hex[:8]}"
        ledger = await connect(url, quotas)
        try:
            await ledger.reserve("t", "before", 10, 5, 1.0)
            for node in nodes:
                node.stop()
            calls = (
                lambda: ledger.reserve("t", "during", 10, 5, 1.0),
                lambda: ledger.account("t"),
                lambda: ledger.reservations("t"),
                lambda: ledger.frozen(),
            )
            for i in range(24):  # a few failed calls in, the client looks for the cluster again: unreachable
                with pytest.raises(LedgerUnavailable, match=r"^redis ledger: "):
                    await calls[i % len(calls)]()
        finally:
            await ledger.close()
