"""A pooled PostgreSQL connection that has been idle is checked before it is lent.

The server may end a connection while it sits in the pool: a restart or a failover, a pooler's idle timeout
(PgBouncer's ``client_idle_timeout``), a load balancer's or a NAT's. Lent as it is, it fails the call that takes it
- and every call of a batch (``postgres_batch``) - with a lost connection, although the server is up.

HikariCP's rule (its ``aliveBypassWindowMs``, 500 ms by default): a connection lent within the last
``ALIVE_BYPASS_S`` is lent unchecked, so a busy pool pays nothing; one idle longer costs one round trip, an empty
query (psycopg_pool's ``check_connection``). One found dead is discarded by the pool, which lends another
(``AsyncConnectionPool(check=...)``: it tries again at once, then after psycopg_pool's backoff of about 1 s, within
the pool's timeout). A connection the server ends within the window still fails the call that takes it.

A check is part of taking a connection from the pool, so it is bounded by the pool's timeout (the URL's
``timeout_s``, 2 s by default: on the request path an outage must be noticed fast). A check the server does not
answer in that time (a paused or partitioned server) has its connection's socket shut down: the empty query fails
at once as a lost connection, with no cancel request (which psycopg waits up to ~10 s for from a server that
answers nothing; an empty query has nothing to cancel). The pool's loop gives up after at most one more such
check (``PoolTimeout``, a lost connection: ``LedgerUnavailable``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any
from weakref import WeakKeyDictionary

import psycopg
from psycopg_pool import AsyncConnectionPool

from fairgate.ledger.postgres_batch import shut_down

# HikariCP's default (com.zaxxer.hikari.aliveBypassWindowMs): under it a connection is taken to be alive.
ALIVE_BYPASS_S = 0.5
Connection = psycopg.AsyncConnection[Any]


class AliveCheck:
    """The pool's ``configure`` (``made``) and ``check`` (``check``) callbacks: when each connection was last
    lent (monotonic seconds, ``clock``), and a check of one idle ``ALIVE_BYPASS_S`` or longer, answered within
    ``timeout_s`` seconds.

    ``checks`` counts the connections checked. Raises (from ``check``) what the empty query raises on a dead
    connection, or on no answer in time (``psycopg.OperationalError``), which the pool takes as "discard it and
    lend another"."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._timeout_s = timeout_s
        self._clock = clock
        self._lent_s: WeakKeyDictionary[Connection, float] = WeakKeyDictionary()
        self.checks = 0

    async def made(self, connection: Connection) -> None:
        """A new connection: alive now (it has just answered the connect)."""
        self._lent_s[connection] = self._clock()

    async def check(self, connection: Connection) -> None:
        """Return when ``connection`` may be lent: at once within the window, else after the empty query."""
        now_s = self._clock()
        last_s = self._lent_s.get(connection)
        self._lent_s[connection] = now_s
        if last_s is not None and now_s - last_s < ALIVE_BYPASS_S:
            return
        self.checks += 1
        timer = asyncio.get_running_loop().call_later(self._timeout_s, shut_down, connection)
        try:
            await AsyncConnectionPool.check_connection(connection)
        finally:
            timer.cancel()
