"""``RedisLedger``: the three interfaces' Redis parts put together, and ``open``, which connects."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import redis.exceptions
from redis.asyncio import BlockingConnectionPool, Redis, RedisCluster
from redis.asyncio.connection import Connection, SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from fairgate.ledger.base import Ledger
from fairgate.ledger.config import Quotas
from fairgate.ledger.model import LedgerUnavailable
from fairgate.ledger.redis.coordination import RedisCoordination
from fairgate.ledger.redis.errors import FAILURES
from fairgate.ledger.redis.operator_api import RedisOperator
from fairgate.ledger.redis.request_path import RedisRequestPath
from fairgate.ledger.redis.store import CLUSTER_CALLS_MAX, POOL_WAIT_S
from fairgate.ledger.redis.url import RedisUrl, parse_url
from fairgate.ledger.text import one_line, redacted

# Connections in one process's pool (per node on a cluster, where ``store.CLUSTER_CALLS_MAX`` calls at once keep
# within it). A call holds one for one script round trip (well under a millisecond), so 64 leave the request path
# no waiting at the concurrency one process serves.
POOL_CONNECTIONS = CLUSTER_CALLS_MAX


class RedisLedger(RedisRequestPath, RedisOperator, RedisCoordination):
    """Ledger on Redis. Build with ``await RedisLedger.open(url, quotas)`` (see the package docstring).

    All times are ms since the epoch on the ledger clock (the server's ``TIME``, or ``clock``).
    """

    @classmethod
    async def open(
        cls, url: str, quotas: Quotas, clock: Callable[[], float] | None = None, *, create: bool = True
    ) -> RedisLedger:
        """Connect to the server named by ``url`` (``redis://host:port/db?prefix=NAME&retention_days=35&timeout_s=2``;
        see ``url.py``), register the scripts and load them on the server.

        Args:
            clock: ms since the epoch, replacing the server's ``TIME`` (tests).
            create: with ``False`` the ledger must exist already (the prefix's tenant registry or any key
                under the prefix): operator commands use it so that a mistyped URL does not quietly
                address an empty ledger. With ``True`` (the default) nothing needs to exist: keys are
                created by the first write.

        Raises:
            ValueError: a bad URL (scheme, host, port, database path, an unknown or repeated parameter, a
                bad ``prefix``, ``retention_days``, ``timeout_s`` or TLS parameter), or a database number
                the server does not have.
            LedgerUnavailable: the server cannot be reached, does not answer within ``timeout_s``, does not
                speak Redis, refuses the credentials or replies with an error (scripts refused included); or
                ``create=False`` and there is no ledger under the prefix.
        """
        settings = parse_url(url)
        client = _client(settings)
        ledger = cls(client, settings, quotas, clock)
        try:
            await ledger._connect(url, settings, create)
        except BaseException as exc:
            await client.aclose()
            if isinstance(exc, FAILURES):
                raise LedgerUnavailable(ledger._server.describe(exc)) from None
            raise
        return ledger

    async def _connect(self, url: str, settings: RedisUrl, create: bool) -> None:
        """PING, SCRIPT LOAD every script, and with ``create=False`` check that the ledger exists (with
        ``create=True``: write every tenant's limits hash, which a script would otherwise ask for on its
        tenant's first call)."""
        try:
            await self._client.ping()
        except redis.exceptions.ResponseError as exc:
            if "DB index" in str(exc):
                raise ValueError(
                    f"ledger URL: database {settings.connection['db']} (the URL path) does not "
                    f"exist on {settings.where}: {one_line(exc)}"
                ) from None
            raise
        async with self._unavailable():
            await self._scripts.load(self._client)
            if create:
                await self._store_limits(self._limits)
            if not create and not await self._exists():
                raise LedgerUnavailable(
                    f"redis ledger: no ledger at {redacted(url)} (create=False): no key "
                    f"under the prefix {self.prefix!r}"
                )

    async def _exists(self) -> bool:
        """Whether anything of this ledger is stored: the tenant registry, or any key under the prefix."""
        if await self._client.exists(self._keys.tenants):
            return True
        for pattern in self._keys.patterns:
            async for _ in self._client.scan_iter(match=pattern, count=1000):  # every node of a cluster
                return True
        return False


def _client(settings: RedisUrl) -> Redis:
    """A client on a blocking pool: a call waits for a free connection rather than failing at once.

    One retry, and only for a connection found closed (a stale pooled connection after a server restart):
    a server that does not answer fails after one timeout, not after a retry storm. On a cluster
    (``cluster=true``), redis-py's cluster client: each call goes to the node of its keys' hash slot (every
    script's keys share one slot, ``keys.py``), ``POOL_CONNECTIONS`` per node.
    """
    retry = Retry(ExponentialBackoff(cap=0.2, base=0.05), 1, supported_errors=(redis.exceptions.ConnectionError,))
    if settings.cluster:
        options = {k: v for k, v in settings.connection.items() if k != "db"}
        cluster = RedisCluster(
            **options,
            ssl=settings.tls,
            max_connections=POOL_CONNECTIONS,
            decode_responses=True,
            socket_connect_timeout=settings.timeout_s,
            socket_timeout=settings.timeout_s,
            retry=retry,
        )
        return cast(Redis, cluster)  # the commands the ledger uses are the same on both
    pool = BlockingConnectionPool(
        connection_class=SSLConnection if settings.tls else Connection,
        max_connections=POOL_CONNECTIONS,
        timeout=max(POOL_WAIT_S, settings.timeout_s),
        decode_responses=True,
        socket_connect_timeout=settings.timeout_s,
        socket_timeout=settings.timeout_s,
        retry=retry,
        **settings.connection,
    )
    return Redis.from_pool(pool)


async def open_ledger(url: str, quotas: Quotas, clock: Callable[[], float] | None, create: bool) -> Ledger:
    """``RedisLedger.open``."""
    return await RedisLedger.open(url, quotas, clock, create=create)
