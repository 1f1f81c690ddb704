"""What every part of the Redis ledger shares: the client, the key names, the scripts, the clock argument,
the tenant registry, the tenants' limits hashes, and the one script call that settles, cancels or expires."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.typing import EncodableT, FieldT

from fairgate.ledger.backend import Backend
from fairgate.ledger.base import tenant_tag
from fairgate.ledger.checks import check_reservation_id
from fairgate.ledger.config import Quotas
from fairgate.ledger.model import LedgerUnavailable, Usage
from fairgate.ledger.redis import codec
from fairgate.ledger.redis.errors import Server
from fairgate.ledger.redis.keys import Keys, tag_of
from fairgate.ledger.redis.lua import Scripts
from fairgate.ledger.redis.url import RedisUrl

# On a cluster, calls in flight at once per process (each takes at most one connection of a node): redis-py's
# cluster client fails a call past a node's ``max_connections`` at once (``MaxConnectionsError``) where the single
# server's blocking pool waits; an outside tester's 100 calls at once failed 36 of them, on a healthy cluster.
CLUSTER_CALLS_MAX = 64
POOL_WAIT_S = 10.0  # how long a call waits for a free pooled connection (on a cluster: for its turn)
REGISTER_EVERY_S = 600.0  # how often a process re-registers a tenant (refreshing the registry's TTL)
LIMITS_PER_WRITE = 500  # limits hashes written per MULTI on open (each MULTI holds the server for its length)
UNCONFIGURED = "-"  # the limits "version" named for a tenant without limits: a key no script reads


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's limits hash (``codec.limits_hash``): its key and what it holds."""

    key: str
    fields: dict[str, bytes | str]


class RedisStore(Backend):
    """The Redis ledger's shared state; ``RedisLedger`` adds the interfaces' methods.

    Attributes:
        prefix: the key prefix (``keys.py``). timeout_s: the bound on connecting and on every reply, s.
        retention_ms: the keys' TTL, ms.
    """

    def __init__(self, client: Redis, settings: RedisUrl, quotas: Quotas, clock: Callable[[], float] | None) -> None:
        super().__init__(quotas)
        self._client = client
        self.prefix = settings.prefix
        self.timeout_s = settings.timeout_s
        self.retention_ms = int(settings.retention_days * 86_400.0 * 1000)
        self._server = Server(settings.where, settings.timeout_s, settings.tls)
        self._keys = Keys(settings.prefix)
        self._clock = clock
        self._registered: dict[str, float] = {}  # tenant -> time.monotonic() of the last registration
        self._limits = self._limits_hashes(quotas)  # tenant tag -> its limits hash
        self._scripts = Scripts.register_on(client)
        # On a cluster a call waits its turn here (``CLUSTER_CALLS_MAX``), as long as the single server's pool waits.
        self._cluster_calls = asyncio.Semaphore(CLUSTER_CALLS_MAX) if settings.cluster else None
        self._cluster_wait_s = max(POOL_WAIT_S, settings.timeout_s)

    def _limits_hashes(self, quotas: Quotas) -> dict[str, TenantLimits]:
        hashes = {}
        for name, quota in quotas.tenants.items():
            tag = tenant_tag(name)
            version, fields = codec.limits_hash(quota)
            hashes[tag] = TenantLimits(self._keys.limits(tag, version), fields)
        return hashes

    def apply_quotas(self, quotas: Quotas) -> None:
        """``Ledger.apply_quotas``. A changed tenant's limits are another hash (its version is a hash of them),
        written by the first script that asks for it (``_with_limits``); the old one stays for the processes
        not reloaded yet, until its TTL."""
        super().apply_quotas(quotas)
        self._limits = self._limits_hashes(quotas)

    @asynccontextmanager
    async def _unavailable(self) -> AsyncIterator[None]:
        """Wraps redis-py's errors (``errors.Server.unavailable``); on a cluster, first waits for one of the
        ``CLUSTER_CALLS_MAX`` turns (``LedgerUnavailable`` when none is free within the pool's wait)."""
        turns = self._cluster_calls
        if turns is None:
            with self._server.unavailable():
                yield
            return
        try:
            async with asyncio.timeout(self._cluster_wait_s):
                await turns.acquire()
        except TimeoutError:
            raise LedgerUnavailable(
                f"redis ledger: {self._server.where}: no turn among {CLUSTER_CALLS_MAX} calls in flight within "
                f"{self._cluster_wait_s:g} s"
            ) from None
        try:
            with self._server.unavailable():
                yield
        finally:
            turns.release()

    def _head(self) -> list[str]:
        """ARGV[1..2] of every tenant script: the clock (empty: the server's TIME) and the retention TTL, ms."""
        return ["" if self._clock is None else codec.number(float(self._clock())), str(self.retention_ms)]

    @staticmethod
    def _tag_of(reservation_id: object) -> str | None:
        """The tenant tag a reservation id starts with (None: not an id this ledger makes). Raises
        ``InvalidUsage`` (not a non-empty string)."""
        return tag_of(check_reservation_id(reservation_id))

    async def _ensure_registered(self, tenant: str) -> None:
        """Put ``tenant`` in the registry (at most every ``REGISTER_EVERY_S`` per process: it refreshes the
        registry's TTL). Raises redis-py's errors (the caller wraps them)."""
        last = self._registered.get(tenant)
        if last is not None and time.monotonic() - last < REGISTER_EVERY_S:
            return
        await self._scripts.register(
            keys=[self._keys.tenants], args=[tenant_tag(tenant), tenant, str(self.retention_ms)]
        )
        self._registered[tenant] = time.monotonic()

    async def _tenants(self) -> dict[str, str]:
        """Registered tenants: tag -> name. Raises redis-py's errors (the caller wraps them)."""
        registry = await self._client.hgetall(self._keys.tenants)
        return {codec.text(tag): codec.text(name) for tag, name in registry.items()}

    def _limited_keys(self, tag: str) -> tuple[list[str], str]:
        """KEYS of a script that applies limits (the tenant's keys, then its limits hash) and its ``configured``
        argument ("1"; "" for a tag no configured tenant has, whose limits key no script reads)."""
        limits = self._limits.get(tag)
        keys = self._keys.tenant(tag)
        if limits is None:
            return [*keys, self._keys.limits(tag, UNCONFIGURED)], ""
        return [*keys, limits.key], "1"

    async def _store_limits(self, tags: Iterable[str]) -> None:
        """Write the limits hashes of ``tags`` (configured ones), each with its TTL, ``LIMITS_PER_WRITE`` per
        round trip: a reader sees a hash whole or not at all (one HSET each). No MULTI: on a cluster the
        tenants' hashes are in different slots. Raises redis-py's errors (the caller wraps them)."""
        chosen = [self._limits[tag] for tag in tags if tag in self._limits]
        for start in range(0, len(chosen), LIMITS_PER_WRITE):
            async with self._client.pipeline(transaction=False) as pipe:
                for limits in chosen[start : start + LIMITS_PER_WRITE]:
                    mapping: dict[FieldT, EncodableT] = dict(limits.fields.items())
                    pipe.hset(limits.key, mapping=mapping)
                    pipe.pexpire(limits.key, self.retention_ms)
                await pipe.execute()

    async def _with_limits(self, tag: str, call: Callable[[], Awaitable[list[Any]]]) -> list[Any]:
        """``call`` (a script that applies the tenant's limits); when it answers ``limits`` (its limits hash is
        not on the server: restarted, flushed, expired) write the hash and call once more. Raises
        ``LedgerUnavailable`` when the hash is missing again (something deletes it as fast as it is written),
        and redis-py's errors (the caller wraps them)."""
        reply = await call()
        if reply[0] != "limits":
            return reply
        await self._store_limits([tag])
        reply = await call()
        if reply[0] == "limits":
            raise LedgerUnavailable(
                f"redis ledger: {self._server.where} lost the limits hash {self._limits[tag].key!r} again right "
                "after it was written (evicted? maxmemory-policy must not evict the ledger's keys)"
            )
        return reply

    async def _close_call(self, reservation_id: str, kind: str, final: bool, billed: Usage | None) -> list[Any]:
        """``close.lua`` (see its header for the replies); ``billed`` None: expire, billing what was billed."""
        tag = self._tag_of(reservation_id)
        if tag is None:
            return ["not_found"]
        amounts = (
            ["", "", ""]
            if billed is None
            else [str(billed.input_tokens), str(billed.output_tokens), codec.number(float(billed.gpu_ms))]
        )
        keys, configured = self._limited_keys(tag)
        args = [*self._head(), reservation_id, kind, "1" if final else "0", *amounts, configured]
        async with self._unavailable():
            reply: list[Any] = await self._with_limits(tag, lambda: self._scripts.close(keys=keys, args=args))
        return reply

    async def close(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()

    async def drop_keys(self) -> None:
        """Delete every key of this ledger's prefix (tests). Raises ``LedgerUnavailable``."""
        async with self._unavailable():
            for pattern in self._keys.patterns:
                batch: list[str] = []
                async for key in self._client.scan_iter(match=pattern, count=500):
                    batch.append(key)
                    if len(batch) >= 500:
                        await self._client.delete(*batch)
                        batch = []
                if batch:
                    await self._client.delete(*batch)
        self._registered.clear()
