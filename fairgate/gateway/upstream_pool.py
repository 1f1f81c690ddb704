"""The upstream's pooled HTTP connections, kept honest: a connection is lent again only when it holds nothing
nobody asked for, a request is sent again only when a reused connection failed at once, and what is read of an
answer the gateway does not relay is bounded.

An outside tester's misbehaving upstreams, each against aiohttp's defaults:

- An answer written twice on a keep-alive connection: aiohttp parses what arrives on an idle pooled connection and
  hands it to the next request on it as its answer. The next request - another tenant's - got the first one's
  tokens, was billed them, and never reached the upstream. ``CleanPoolConnector`` lends no connection that holds
  bytes (aiohttp's own ``should_close``: buffered data, an unfinished body, an error); it is closed instead.
- A retry "on a reused connection, before any byte came back" was made after any disconnect: on a fresh connection
  the upstream had read whole, after the upstream held the request 2 s, after a partial head. Each ran twice. A
  stale pooled connection (llama-server closes ~12 % of those reused right after a stream) fails the moment it is
  written to; ``stale_retry_allowed`` takes only a reused connection that failed within ``STALE_RETRY_WINDOW_S``.
- Error bodies and what followed ``[DONE]`` were read whole: a 500 of 400 KB gzip (400 MB inflated) took the
  gateway from 88 MB to 899 MB. ``read_capped`` reads at most a bound, within a time; answers are asked
  uncompressed (``Accept-Encoding: identity``) and read as sent.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import time
from typing import Any, cast

import aiohttp
from aiohttp.client_proto import ResponseHandler

# How soon after it was sent a request on a reused connection may fail and be sent again: a stale connection fails
# on its first write (the upstream had closed it: its reset or end is already there). Later, the upstream may have
# read and run it.
STALE_RETRY_WINDOW_S = 0.25
# Bytes of an answer read when nothing of it is relayed: an error body (2,000 characters are quoted), what follows
# ``[DONE]`` (an engine ends the body at once: a few bytes).
UNRELAYED_BYTES_MAX = 64 * 1024
CHUNKED_END = b"0\r\n\r\n"  # the last chunk of a chunked body (RFC 9112, 7.1), no trailers


class _CountingHandler(ResponseHandler):
    """aiohttp's protocol of a connection, counting the bytes it received (``stale_retry_allowed``), keeping the
    last few and whether its last answer's body was chunked (``CleanPoolConnector``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.received_bytes = 0
        self.released_bytes = 0  # received when it last went back to the pool
        self.last_bytes = b""
        self.chunked = False

    def data_received(self, data: bytes) -> None:
        self.received_bytes += len(data)
        # Every read of every stream passes here: its tail is sliced, the read itself not copied.
        end = len(CHUNKED_END)
        self.last_bytes = data[-end:] if len(data) >= end else (self.last_bytes + data)[-end:]
        super().data_received(data)

    def feed_data(self, data: Any, size: int = 0) -> None:
        """An answer's head parsed, with its body's reader (aiohttp's ``DataQueue``)."""
        self.chunked = bool(getattr(data[0], "chunked", False))
        super().feed_data(data, size)


# The pooled connection lent to this task's request, and the bytes it had received then (None: a new one).
_lent: contextvars.ContextVar[tuple[_CountingHandler, int] | None] = contextvars.ContextVar(
    "fairgate_upstream_lent", default=None
)


class CleanPoolConnector(aiohttp.TCPConnector):
    """``aiohttp.TCPConnector`` that lends no pooled connection holding bytes nobody asked for (closed instead:
    see the module's docstring), and notes in the calling task which pooled connection it lends
    (``stale_retry_allowed``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # aiohttp makes each connection's protocol with its connector's factory (``BaseConnector._factory``).
        self._factory = cast("functools.partial[ResponseHandler]", functools.partial(_CountingHandler, loop=self._loop))

    def _release(self, key: Any, protocol: ResponseHandler, *, should_close: bool = False) -> None:
        """Back to the pool only when what it received ends where a chunked answer ends: bytes past that end in
        the same read (a stray answer begun) sit in aiohttp's parser, where ``should_close`` does not see them,
        and an outside tester's next request got the stray. (An answer of a given length cannot be told apart
        this way: those are small JSON answers of the engine's own endpoints, not a tenant's tokens.)"""
        if isinstance(protocol, _CountingHandler):
            protocol.released_bytes = protocol.received_bytes
            should_close = should_close or (protocol.chunked and not protocol.last_bytes.endswith(CHUNKED_END))
        super()._release(key, protocol, should_close=should_close)

    async def _get(self, key: Any, traces: Any) -> Any:
        while True:
            connection = await super()._get(key, traces)
            if connection is None:
                return None
            protocol = connection.protocol
            if (
                isinstance(protocol, _CountingHandler)
                and not protocol.should_close
                and protocol.received_bytes == protocol.released_bytes  # nothing came while it was pooled
            ):
                _lent.set((protocol, protocol.received_bytes))
                return connection
            connection.close()  # what it holds is no answer to anything asked: never read as one


def sending() -> float:
    """Call before a request is sent: clears the task's note of a lent connection; returns the send time
    (monotonic s) for ``stale_retry_allowed``."""
    _lent.set(None)
    return time.monotonic()


def stale_retry_allowed(sent_s: float) -> bool:
    """Whether a request sent at ``sent_s`` (``sending``) that failed may be sent again on a fresh connection: it
    went on a pooled connection, which received no byte since it was lent, and it failed within
    ``STALE_RETRY_WINDOW_S``."""
    lent = _lent.get()
    if lent is None:
        return False
    protocol, received_then = lent
    return protocol.received_bytes == received_then and time.monotonic() - sent_s <= STALE_RETRY_WINDOW_S


async def read_capped(
    response: aiohttp.ClientResponse, timeout_s: float, max_bytes: int = UNRELAYED_BYTES_MAX
) -> tuple[bytes, bool]:
    """Up to ``max_bytes`` of ``response``'s body, read within ``timeout_s``, and whether that was all of it.
    Raises ``TimeoutError`` and aiohttp's errors."""
    pieces: list[bytes] = []
    left = max_bytes
    async with asyncio.timeout(timeout_s):
        while left > 0:
            piece = await response.content.read(left)
            if not piece:
                return b"".join(pieces), True
            pieces.append(piece)
            left -= len(piece)
        return b"".join(pieces), response.content.at_eof()
