"""An upstream stream read in a task of its own, so that the meter sees each token when it arrives.

The live meter stamps a token, and a call's end, when the upstream stream yields it (``UpstreamClient.stream``).
Read by the relay itself, a token waiting in the socket while the relay awaited something else - a partial
settlement on a slow or refusing ledger, a client reading slowly - was stamped late, and the wait was billed as
GPU time: an outside tester's PostgreSQL refusing connections for 5 s billed a stream 3.3x what the replica spent
(6,638-6,853 ms of 2,034), a relay held by a slow client 1.4-1.6x. ``ReadAhead`` keeps reading while the relay
waits, up to ``READ_AHEAD_READS_MAX`` upstream reads; past that the reads wait for the relay (the meter then
stamps late again, as a bounded buffer must).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

from fairgate.gateway.upstream import CallState

# 512 reads: a read is about one decode step's tokens (one chunk a sequence), so 10 s of a stream at 20 ms a step,
# longer than the ledger's timeouts that held the relay in the tester's runs (SQLite's busy timeout 2 s,
# PostgreSQL's connect timeout 5 s). A parsed one-token chunk is ~1.5 KB of Python objects (measured,
# sys.getsizeof over a vLLM completion chunk): at most ~0.75 MB held for a client that stops reading.
READ_AHEAD_READS_MAX = 512
# With that many reads waiting, a caller that takes none for this long has a client that stopped reading (the
# relay waits on nothing else that long: its partial settlements run beside it, its first-token settlement within
# the ledger's timeout). The upstream is then cut: an outside tester's client that stopped reading kept its call
# on the meter for the whole stall (55 s billed for 30 s the replica spent, the others under-billed, its slot and
# budget stop held) - an engine generates on whether or not the client reads, and the meter could not see it end.
READ_AHEAD_STALL_S = 10.0

_END = object()
log = logging.getLogger("fairgate.gateway")


class ClientStalled(Exception):
    """The client took nothing for ``READ_AHEAD_STALL_S`` with the read-ahead full: the upstream was cut there."""

    code = "client_too_slow"

    def sse_event(self) -> str:
        """The terminal server-sent event of the stream it stops (an OpenAI error object)."""
        error = {"message": str(self), "type": "invalid_request_error", "param": None, "code": self.code}
        return f"data: {json.dumps({'error': error})}\n\n"


class ReadAhead:
    """The chunks of ``stream``, read ahead of the caller by a task of its own started at the first ask.

    Iterating it yields the chunks in order; ``more`` tells whether another chunk is already here (the relay
    writes chunks that came together in one write). What ``stream`` raises (``UpstreamError``,
    ``BudgetSpent``) is raised to the caller after the chunks read before it. ``aclose`` stops the reading
    task and closes ``stream`` (the upstream stops the sequence: the meter takes the call as cut there).

    Args:
        stream: an upstream stream (``UpstreamClient.stream``): parsed SSE chunks.
        call: its call; ``call.more_buffered`` says whether a chunk just yielded has another in the same read.
        reads_max: upstream reads held for the caller at most.
        stall_s: how long a full read-ahead waits for the caller before the upstream is cut (``ClientStalled``
            is raised after the chunks read).
        on_end: called once the upstream stream has ended (read to its end, failed, cut or closed), in the
            reading task; what it raises is logged.
        on_read: called after each upstream read, in the reading task, before it is queued (whether or not the
            caller takes anything); an exception it returns stops the stream there, raised to the caller after
            the chunks read.
    """

    def __init__(
        self,
        stream: AsyncGenerator[dict[str, Any], None],
        call: CallState,
        reads_max: int = READ_AHEAD_READS_MAX,
        stall_s: float = READ_AHEAD_STALL_S,
        on_end: Callable[[], None] | None = None,
        on_read: Callable[[], BaseException | None] | None = None,
    ) -> None:
        self._stream, self._call, self._stall_s = stream, call, stall_s
        self._on_end, self._on_read = on_end, on_read
        self._reads: asyncio.Queue[list[dict[str, Any]] | BaseException | object] = asyncio.Queue(reads_max)
        self._task: asyncio.Task[None] | None = None
        self._read: list[dict[str, Any]] = []  # the read being handed out, in order
        self._next = 0  # the index in ``_read`` of the next chunk to hand out
        self._queued = 0  # reads in ``_reads`` (beside them, the end or what the stream raised)
        self._ended = False

    @property
    def more(self) -> bool:
        """Another chunk is here already: the rest of the same read, or a read queued behind it."""
        return self._next < len(self._read) or self._queued > 0

    def __aiter__(self) -> ReadAhead:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._next < len(self._read):
            self._next += 1
            return self._read[self._next - 1]
        if self._ended:
            raise StopAsyncIteration
        if self._task is None:
            self._task = asyncio.ensure_future(self._pump())
        item = await self._reads.get()
        if isinstance(item, list):
            self._queued -= 1
            self._read, self._next = item, 1
            return item[0]
        self._ended = True
        if isinstance(item, BaseException):
            raise item
        raise StopAsyncIteration

    async def _pump(self) -> None:
        """Read ``stream`` to its end, one queued list per upstream read (``call.more_buffered``); then the end,
        or what it raised."""
        read: list[dict[str, Any]] = []
        end: BaseException | object = _END
        try:
            async for chunk in self._stream:
                read.append(chunk)
                if not self._call.more_buffered:
                    stop = self._on_read() if self._on_read is not None else None
                    if stop is not None:  # the caller stops the request: this read is its last
                        end = stop
                        break
                    if not await self._put(read, self._stall_s):
                        end = ClientStalled(
                            f"The client read nothing for {self._stall_s:g} s while the model generated; the request "
                            f"was stopped after {self._call.output_tokens} tokens (billed as generated)."
                        )
                        break
                    read = []
        except Exception as exc:  # the caller's to handle, after the chunks read before it
            end = exc
        finally:
            with contextlib.suppress(Exception):  # cancelled (``aclose``) at a ``put``: the stream stops there
                await self._stream.aclose()
            self._ended_upstream()
        if read:
            await self._put(read)
        await self._reads.put(end)

    def _ended_upstream(self) -> None:
        if self._on_end is not None:
            try:
                self._on_end()
            except Exception:  # the caller's clean-up runs again at its end (``aclose``)
                log.exception("read-ahead: the upstream's end could not be handled")

    async def _put(self, read: list[dict[str, Any]], within_s: float | None = None) -> bool:
        """Queue ``read``; False (not queued) when it found no room within ``within_s`` (None: waits)."""
        self._queued += 1  # before the put: once it is in, the caller may take it before this task runs again
        try:
            async with asyncio.timeout(within_s):
                await self._reads.put(read)
        except TimeoutError:
            self._queued -= 1
            return False
        return True

    async def aclose(self) -> None:
        """Stop reading and close the upstream stream; at once when nothing was asked yet. A cancellation of
        the caller meanwhile is raised once the reading task has ended."""
        self._ended = True
        task = self._task
        if task is None:
            await self._stream.aclose()
            self._ended_upstream()
            return
        task.cancel()
        cancelled: asyncio.CancelledError | None = None
        while not task.done():  # the call's settlement reads what the meter booked as the stream closed
            try:
                await asyncio.wait({task})
            except asyncio.CancelledError as exc:
                cancelled = exc
        if cancelled is not None:
            raise cancelled
