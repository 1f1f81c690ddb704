"""What every part of the Redis ledger shares: the client, the key names, the scripts, the clock argument,
the tenant registry, and the one script call that settles, cancels or expires."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from redis.asyncio import Redis

from fairgate.ledger.backend import Backend
from fairgate.ledger.base import tenant_tag
from fairgate.ledger.checks import check_reservation_id
from fairgate.ledger.config import Quotas
from fairgate.ledger.model import Usage
from fairgate.ledger.redis import codec
from fairgate.ledger.redis.errors import Server
from fairgate.ledger.redis.keys import Keys, tag_of
from fairgate.ledger.redis.lua import Scripts
from fairgate.ledger.redis.url import RedisUrl

REGISTER_EVERY_S = 600.0  # how often a process re-registers a tenant (refreshing the registry's TTL)


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
        self._limits_json = {
            tenant_tag(name): json.dumps(
                {
                    "base": codec.limits_spec(t.limits),
                    "classes": {mc: codec.limits_spec(lim) for mc, lim in t.by_model_class.items()},
                }
            )
            for name, t in quotas.tenants.items()
        }
        self._scripts = Scripts.register_on(client)

    def _unavailable(self) -> AbstractContextManager[None]:
        """Wraps redis-py's errors (``errors.Server.unavailable``)."""
        return self._server.unavailable()

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
        with self._unavailable():
            reply: list[Any] = await self._scripts.close(
                keys=self._keys.tenant(tag),
                args=[
                    *self._head(),
                    reservation_id,
                    kind,
                    "1" if final else "0",
                    *amounts,
                    self._limits_json.get(tag, ""),
                ],
            )
        return reply

    async def close(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()

    async def drop_keys(self) -> None:
        """Delete every key of this ledger's prefix (tests). Raises ``LedgerUnavailable``."""
        with self._unavailable():
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
