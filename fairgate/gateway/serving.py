"""How the gateway is served: uvicorn with httptools, and bounds on what a connection may make it hold
before a request reaches the app (authentication included).

uvicorn bounds none of this itself with httptools: httptools gathers a header's value by appending
each piece it reads (``_current_header_value += val`` in its ``parser.pyx``), with no limit and in quadratic
time: ten connections sending a 20 MB header each raised an unbounded gateway's RSS from 64 to 314 MB (one
150 MB header took 53 s to read); under these bounds the RSS moved by under 1 MB. uvicorn counts no
headers, has no timer on a request's head or body, and arms its keep-alive timer only after a response (a
connection that never sends a byte stays open). h11's ``max_incomplete_event_size`` bounds only the head's
size (answered as a 400), and only with uvicorn's pure-Python h11 parser.

``BoundedHttpTools`` is uvicorn's httptools protocol with these bounds (``Bounds``), enforced as bytes
arrive, before the parser buffers them:

- the head (request line and headers) is fed to the parser at most ``max_header_bytes`` at a time; a head
  longer than that, or with more than ``max_headers`` fields, is answered 431 and the connection closed;
- a head not complete ``header_timeout_s`` after its first byte, or a body not complete ``body_timeout_s``
  after its head, is answered 408 (when no answer has started) and the connection closed: the app sees the
  client leave, and as bodies are read before admission, nothing is reserved;
- a connection with no request in progress is closed after ``keep_alive_s``, from the moment it opens too;
- ``max_connections`` is uvicorn's ``limit_concurrency``: a request beyond it gets a 503.

A refused connection is closed after a short linger that discards what the client still sends: closing a
socket with unread data makes the kernel answer with a reset, which can destroy the answer before the client
reads it (as nginx's ``lingering_close`` avoids).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from fairgate.gateway.config import GatewaySection

LINGER_S = 2.0  # after a refusal, how long what the client still sends is read and dropped before closing


@dataclass(frozen=True)
class Bounds:
    """What one connection may hold or take (see the module docstring): the ``[gateway]`` keys of the same
    names, which hold their defaults and bounds."""

    max_header_bytes: int
    max_headers: int
    header_timeout_s: float
    body_timeout_s: float
    keep_alive_s: float
    max_connections: int

    @classmethod
    def of(cls, section: GatewaySection) -> Bounds:
        return cls(**{f.name: getattr(section, f.name) for f in fields(cls)})


def _answer(status: int, reason: str, code: str, message: str) -> bytes:
    """A complete HTTP/1.1 answer that closes the connection, its body OpenAI's error shape."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}})
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return (head + body).encode("ascii")


class _Refused(Exception):
    """Raised in a parser callback to stop parsing a request that is refused."""


class BoundedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol under ``bounds`` (a subclass per ``Bounds``: see ``protocol_class``)."""

    bounds: ClassVar[Bounds]  # set by ``protocol_class``

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # reading a request's line and headers (not yet complete)
        self._head_bytes = 0  # bytes of the current head fed to the parser so far
        self._header_count = 0
        self._refusal: bytes | None = None  # set by a callback that refuses the request
        self._lingering = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # uvicorn arms keep-alive only after a response: a connection that never sends would stay open.
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return
        while data and self._in_head:
            if self._head_timer is None and self._answer_free():
                self._head_timer = self.loop.call_later(self.bounds.header_timeout_s, self._head_late)
            allowance = self.bounds.max_header_bytes - self._head_bytes
            if allowance <= 0:
                too_large = self._too_large(f"longer than {self.bounds.max_header_bytes} bytes")
                self._refuse(too_large if self._answer_free() else b"")
                return
            piece, data = data[:allowance], data[allowance:]
            self._head_bytes += len(piece)
            if not self._feed(piece):
                return
        if data:
            # The body, and possibly (pipelined) the start of the next head: its bytes in this read are not
            # counted against the next head's bound, which may so be exceeded by one read (at most 256 KB:
            # uvloop's UV_STREAM_RECV_BUF_SIZE, asyncio's _SelectorTransport.max_size).
            self._feed(data)

    def _feed(self, data: bytes) -> bool:
        """uvicorn's ``data_received``, but a request refused by a callback gets its own answer (uvicorn's
        would be a 400 "Invalid HTTP request"); False when the connection is refused or closing."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError:
            if self._refusal is None:
                self.logger.warning("Invalid HTTP request received.")
                self.send_400_response("Invalid HTTP request received.")
                return False
            self._refuse(self._refusal if self._answer_free() else b"")
            return False
        return not self.transport.is_closing()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_count = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.bounds.max_headers:
            self._refusal = self._too_large(f"more than {self.bounds.max_headers} header fields")
            raise _Refused  # httptools stops parsing and raises HttpParserCallbackError from feed_data
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel(self._head_timer)
        self._head_timer = None
        super().on_headers_complete()
        self._body_timer = self.loop.call_later(self.bounds.body_timeout_s, self._body_late)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._cancel(self._body_timer)
        self._body_timer = None
        self._in_head = True
        self._head_bytes = 0

    def _answer_free(self) -> bool:
        """No response is being written on this connection (an answer of ours would corrupt it)."""
        return self.cycle is None or self.cycle.response_complete

    def _too_large(self, what: str) -> bytes:
        return _answer(
            431,
            "Request Header Fields Too Large",
            "header_fields_too_large",
            f"The request's headers are {what}; the gateway's limit is {self.bounds.max_headers} fields and "
            f"{self.bounds.max_header_bytes} bytes.",
        )

    def _head_late(self) -> None:
        self._head_timer = None
        message = f"The request's headers did not arrive within {self.bounds.header_timeout_s:g} s."
        self._refuse(_answer(408, "Request Timeout", "request_timeout", message) if self._answer_free() else b"")

    def _body_late(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if cycle is None or not cycle.more_body:  # pragma: no cover - the timer is cancelled when it completes
            return
        message = f"The request body did not arrive within {self.bounds.body_timeout_s:g} s."
        answer = b""
        if not cycle.response_started:
            answer = _answer(408, "Request Timeout", "request_timeout", message)
        if not cycle.response_complete:
            # The app waits for the body: it sees the client leave, and what it answers is dropped.
            cycle.disconnected = True
            cycle.message_event.set()
        self._refuse(answer)

    def _refuse(self, answer: bytes) -> None:
        """Write ``answer`` (empty: none, as a response is under way), stop reading requests, and close after
        ``LINGER_S`` of dropping what the client still sends."""
        self._refusal = None
        self._cancel_timers()
        self._unset_keepalive_if_required()
        if self.transport.is_closing() or self._lingering:
            return
        self._lingering = True
        if answer:
            self.transport.write(answer)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.flow.resume_reading()
        self.loop.call_later(LINGER_S, self.transport.close)

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            self._cancel(timer)
        self._head_timer = self._body_timer = None

    @staticmethod
    def _cancel(timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()


def protocol_class(bounds: Bounds) -> type[BoundedHttpTools]:
    """``BoundedHttpTools`` bound to ``bounds`` (uvicorn makes a protocol per connection from a class)."""
    return type("BoundedHttpTools", (BoundedHttpTools,), {"bounds": bounds})


def uvicorn_config(app: Any, section: GatewaySection, host: str, port: int, **options: Any) -> uvicorn.Config:
    """uvicorn's config serving ``app`` on ``host:port`` under ``section``'s connection bounds."""
    bounds = Bounds.of(section)
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol_class(bounds),
        # uvicorn refuses a request when its open connections (the asking one included) reach the limit.
        limit_concurrency=bounds.max_connections + 1,
        timeout_keep_alive=bounds.keep_alive_s,  # type: ignore[arg-type]  # used as a float (loop.call_later)
        **options,
    )


__all__ = ["LINGER_S", "BoundedHttpTools", "Bounds", "protocol_class", "uvicorn_config"]
