"""A pooled PostgreSQL connection that has been idle is checked before it is lent; one found dead is replaced.

The server may end a connection while it sits in the pool: a restart or a failover, a pooler's idle timeout
(PgBouncer's ``client_idle_timeout``), a load balancer's or a NAT's. Lent as it is, it fails the call that takes it
- and every call of a batch (``postgres_batch``) - with a lost connection, although the server is up.

HikariCP's rule (its ``aliveBypassWindowMs``, 500 ms by default): a connection lent within the last
``ALIVE_BYPASS_S`` is lent unchecked, so a busy pool pays nothing; one idle longer costs one round trip, an empty
query (psycopg_pool's ``check_connection``). A connection the server ends within the window still fails the call
that takes it.

One the check finds dead is closed, not raised: the pool's own answer to a failed check is to try again after a
backoff (at once, then ~1 s, then the rest of its timeout), so a caller got past at most three dead connections
within the 2 s timeout, and after a restart the first calls failed with the server up (an outside tester's
finding: 3 dead connections of 8 failed the next call, 8 failed two). ``lent`` hands a closed one back (the pool
replaces it) and takes the next at once, up to ``LEND_TRIES`` times: a pool of dead connections costs a round
trip each.

A check is part of taking a connection, so it is bounded by the pool's timeout (the URL's ``timeout_s``, 2 s by
default: on the request path an outage must be noticed fast). A check the server does not answer in that time
(a paused or partitioned server) has its connection's socket shut down, and raises: the pool's loop then gives up
within its timeout (``PoolTimeout``, a lost connection: ``LedgerUnavailable``). Shut down, not cancelled: psycopg
waits up to 10 s for its cancel request from a server that answers nothing, and an empty query has nothing to
cancel. A connection a NAT or a firewall dropped without a reset looks the same, and costs the call that checks
it the pool's timeout (one such connection a call); libpq's TCP keepalives (the URL's ``keepalives_idle``,
``keepalives_interval``, ``keepalives_count``) find those while they are idle.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any
from weakref import WeakKeyDictionary

import psycopg
from psycopg_pool import AsyncConnectionPool

# HikariCP's default (com.zaxxer.hikari.aliveBypassWindowMs): under it a connection is taken to be alive.
ALIVE_BYPASS_S = 0.5
# Connections ``lent`` takes before it gives up: more than a pool holds (postgres.POOL_CONNECTIONS, 8), so a pool
# of dead connections is got past and a new one reached.
LEND_TRIES = 10
Connection = psycopg.AsyncConnection[Any]


class AliveCheck:
    """The pool's ``configure`` (``made``) and ``check`` (``check``) callbacks: when each connection was last
    lent (monotonic seconds, ``clock``), and a check of one idle ``ALIVE_BYPASS_S`` or longer, answered within
    ``timeout_s`` seconds.

    ``checks`` counts the connections checked, ``dead`` those found dead (and closed). Raises (from ``check``)
    ``psycopg.OperationalError`` when the check has no answer in time, which the pool takes as "discard it"."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._timeout_s = timeout_s
        self._clock = clock
        self._lent_s: WeakKeyDictionary[Connection, float] = WeakKeyDictionary()
        self.checks = 0
        self.dead = 0

    async def made(self, connection: Connection) -> None:
        """A new connection: alive now (it has just answered the connect)."""
        self._lent_s[connection] = self._clock()

    async def check(self, connection: Connection) -> None:
        """Return when ``connection`` may be lent - at once within the window, else after the empty query - or
        closed (dead: ``lent`` takes another)."""
        now_s = self._clock()
        last_s = self._lent_s.get(connection)
        self._lent_s[connection] = now_s
        if last_s is not None and now_s - last_s < ALIVE_BYPASS_S:
            return
        self.checks += 1
        cut: list[bool] = []
        timer = asyncio.get_running_loop().call_later(self._timeout_s, _cut, connection, cut)
        try:
            await AsyncConnectionPool.check_connection(connection)
        except psycopg.Error:
            if cut:
                raise psycopg.OperationalError(f"no answer to a check within {self._timeout_s:g} s") from None
            self.dead += 1
            await connection.close()
        finally:
            timer.cancel()


@asynccontextmanager
async def lent(pool: AsyncConnectionPool[Any], timeout_s: float | None = None) -> AsyncIterator[Connection]:
    """A connection of ``pool`` that its check did not find dead (``AliveCheck``): a closed one is handed back
    (the pool replaces it) and the next taken at once, up to ``LEND_TRIES`` times, each waited for at most
    ``timeout_s`` (default: the pool's timeout). Raises what the pool raises (``PoolTimeout``: none in time), or
    ``psycopg.OperationalError`` after ``LEND_TRIES`` dead ones."""
    for _ in range(LEND_TRIES):
        async with pool.connection(timeout=timeout_s) as connection:
            if not connection.closed:
                yield connection
                return
    raise psycopg.OperationalError(f"{LEND_TRIES} pooled connections in a row found dead")


def _cut(connection: Connection, cut: list[bool]) -> None:
    cut.append(True)
    shut_down(connection)


def shut_down(connection: Connection) -> None:
    """Shut ``connection``'s socket down both ways (a duplicate of its descriptor, so libpq's stays open): what
    waits on it fails as a lost connection, at once."""
    try:
        descriptor = connection.pgconn.socket
    except psycopg.OperationalError:  # closed already
        return
    with socket.socket(fileno=os.dup(descriptor)) as duplicate:
        duplicate.shutdown(socket.SHUT_RDWR)
