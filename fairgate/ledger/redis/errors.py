"""redis-py's errors, wrapped once: every failure talking to the server (connection, timeout, protocol, an
error reply) becomes a one-line ``LedgerUnavailable`` naming the real cause; an argument redis-py cannot
send is the caller's ``InvalidUsage``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import redis.exceptions

from fairgate.ledger.model import InvalidUsage, LedgerUnavailable
from fairgate.ledger.text import one_line

# What a server or the network can raise. A cluster's own failures (no node reachable: ``RedisClusterUnreachableError``,
# a slot no node serves) are not ``RedisError``s in redis-py 8: an outside tester's cluster outage escaped as them, a
# gateway answered 500 and its liveness sweep died.
FAILURES = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError)


@dataclass(frozen=True)
class Server:
    """What messages say about the server: ``where`` (host:port), the timeout, whether TLS was asked for."""

    where: str
    timeout_s: float
    tls: bool

    def describe(self, exc: BaseException) -> str:
        """One line naming the real cause of a redis-py (or socket) failure talking to the server."""
        text = one_line(exc) or type(exc).__name__
        where = self.where
        if isinstance(exc, redis.exceptions.TimeoutError | TimeoutError):
            hint = (
                "; the URL asks for TLS (rediss://): does the server speak TLS?"
                if self.tls and "connecting" in text.lower()
                else ""
            )
            return f"redis ledger: {where} did not answer within {self.timeout_s:g} s ({text}){hint}"
        if isinstance(exc, redis.exceptions.InvalidResponse):
            return f"redis ledger: {where} does not speak the Redis protocol ({text})"
        if isinstance(exc, redis.exceptions.AuthenticationError):
            return f"redis ledger: {where} refused the credentials: {text}"
        if isinstance(exc, redis.exceptions.ResponseError) or type(exc) is redis.exceptions.BusyLoadingError:
            code = getattr(exc, "status_code", None)
            reply = f"{code} {text}" if code and not text.startswith(code) else text
            return f"redis ledger: {where} replied with an error: {reply}"
        if where in text:
            return f"redis ledger: {text}"
        return f"redis ledger: {where}: {text}"

    @contextmanager
    def unavailable(self) -> Iterator[None]:
        """Map every redis-py failure to a one-line ``LedgerUnavailable`` (``describe``), and an argument
        redis-py refused (``DataError``) to ``InvalidUsage``."""
        try:
            yield
        except redis.exceptions.DataError as exc:  # redis-py refused an argument: the caller's input
            raise InvalidUsage(f"redis ledger: {one_line(exc) or 'invalid argument'}") from None
        except FAILURES as exc:
            raise LedgerUnavailable(self.describe(exc)) from None
