"""A TCP proxy on loopback that a test can cut and restore: a real network outage between a client and a
server (the ledger's PostgreSQL or Redis) without touching the shared server itself."""

from __future__ import annotations

import asyncio
import contextlib


class CuttableProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target_host:target_port`` until ``cut()``.

    ``cut()`` closes every open connection and refuses new ones (they are accepted and closed at once);
    ``restore()`` forwards again. ``drop_next_request()``: the next bytes a client sends on any connection
    (that start with a given prefix) are not forwarded, and that connection is closed (a server closing a
    kept-alive connection just as it is reused). ``accepted``: connections accepted so far; ``opened_by``: the
    first line a client sent on each (for HTTP, the request line of its first request), in order.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._server: asyncio.base_events.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self.up = True
        self.accepted = 0
        self.opened_by: list[str] = []
        self._drop_next: bytes | None = None

    async def start(self) -> CuttableProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def drop_next_request(self, starting: bytes = b"") -> None:
        """Swallow the next bytes a client sends that start with ``starting`` (any, by default), and close
        that connection."""
        self._drop_next = starting

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, back: asyncio.StreamWriter | None = None
    ) -> None:
        """Forward ``reader`` to ``writer``; ``back``: the client's side, when ``reader`` is the client's."""
        first = back is not None
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                if first:
                    self.opened_by.append(data.split(b"\r\n", 1)[0].decode(errors="replace"))
                    first = False
                if back is not None and self._drop_next is not None and data.startswith(self._drop_next):
                    self._drop_next = None
                    back.close()
                    break
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if not self.up:
            writer.close()
            return
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._open.update((writer, upstream_writer))
        await asyncio.gather(self._pipe(reader, upstream_writer, writer), self._pipe(upstream_reader, writer))
        self._open.difference_update((writer, upstream_writer))

    def cut(self) -> None:
        self.up = False
        for writer in list(self._open):
            writer.close()
        self._open.clear()

    def restore(self) -> None:
        self.up = True

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
