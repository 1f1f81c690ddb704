"""A misbehaving OpenAI-compatible upstream, written byte for byte on raw sockets: the failures a real
replica, or a proxy in front of it, can put on the wire - an HTML error page, a 200 that is not an event
stream, broken SSE framing, a mid-stream error, a stall before or after the headers, a connection closed
before the headers or mid-stream, a usage report that contradicts what it streamed.

Each request picks its misbehaviour by the first word of its prompt (a completion's ``prompt``, a chat's
last message): one of ``MODES``; any other word gets a well-behaved stream. Every answer streams
``TOKENS`` pieces of ``PIECE`` (a chat ``delta.content`` or a completion ``text``) where it streams at all,
and closes the connection after it (``connection: close``), so no failure leaks into the next request.

``serve_bad_upstream()`` runs it on 127.0.0.1 on a thread of its own and yields it (``url``: the base URL
without ``/v1``, as ``ReplicaModel.upstream`` takes it; ``modes``: the mode of every request received).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from fairgate.api.tokens import CHAT_MESSAGE_OVERHEAD_TOKENS
from fairgate.harness.process import STARTUP_S_MAX

TOKENS = 6
PIECE = " w"
CUT_AFTER = 3  # pieces a mode that breaks mid-stream sends first
SPLIT_PAUSE_S = 0.01  # split_lines: between the two halves of an event
PAST_MAX_TOKENS = 200  # past_max_tokens: pieces sent in one write, more than a request's max_tokens
LATE_FIRST_S = 3.0  # late_first: how long after the head the first piece comes
TOOL_CALLS_NOT_A_LIST = b'data: {"choices": [{"index": 0, "delta": {"tool_calls": 1}}]}\n\n'
ENDLESS_LINE_BYTES = 3 << 20  # endless_line: one line longer than the gateway reads (1 MiB, twice buffered)
BREAK_AFTER_S = 0.2  # close_mid: how long after its pieces the body breaks
STALL_S_MAX = 60.0  # a stalled answer gives up after this long if the gateway never hangs up
HTML = b"<html><head><title>502 Bad Gateway</title></head><body><center><h1>502 Bad Gateway</h1></center></body></html>"


@dataclass
class _Request:
    chat: bool
    mode: str
    prompt_tokens: int  # as the emulated replica counts them: words, plus 3 per chat message
    writer: asyncio.StreamWriter
    reader: asyncio.StreamReader

    def chunk(self, text: str | None = None, finish: str | None = None) -> bytes:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish}
        return self.data({"id": "bad-1", "object": "chunk", "model": "emu", "choices": [choice]})

    @staticmethod
    def data(document: object) -> bytes:
        return f"data: {json.dumps(document)}\n\n".encode()

    def delta(self, field: str) -> bytes:
        """A chat chunk generating ``PIECE`` in ``field``: ``content``, ``reasoning_content``, ``tool_calls`` (as
        a tool call's arguments) or ``function_call`` (OpenAI's older field)."""
        delta: dict[str, Any] = {field: PIECE}
        if field == "tool_calls":
            delta = {"tool_calls": [{"index": 0, "function": {"arguments": PIECE}}]}
        elif field == "function_call":
            delta = {"function_call": {"arguments": PIECE}}
        choice = {"index": 0, "delta": delta, "finish_reason": None}
        return self.data({"id": "bad-1", "object": "chunk", "model": "emu", "choices": [choice]})

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
        return self.data({"id": "bad-1", "object": "chunk", "choices": [], "usage": usage})

    async def send(self, *parts: bytes) -> None:
        self.writer.write(b"".join(parts))
        await self.writer.drain()

    async def head(self, status: str = "200 OK", kind: str = "text/event-stream", extra: str = "") -> None:
        await self.send(f"HTTP/1.1 {status}\r\ncontent-type: {kind}\r\nconnection: close\r\n{extra}\r\n".encode())

    async def stall(self) -> None:
        """Send nothing more until the gateway hangs up (or ``STALL_S_MAX``)."""
        with contextlib.suppress(TimeoutError, ConnectionError):
            await asyncio.wait_for(self.reader.read(), STALL_S_MAX)

    async def stream(
        self, tokens: int, usage: tuple[int, int] | None = None, done: bool = True, head: bool = True
    ) -> None:
        """The head (unless sent already) and ``tokens`` pieces, then (when ``usage`` is given) the finish,
        usage and ``[DONE]``."""
        if head:
            await self.head()
        await self.send(*(self.chunk(PIECE) for _ in range(tokens)))
        if usage is not None:
            await self.send(self.chunk(None, "stop"), self.usage(*usage))
        if done:
            await self.send(b"data: [DONE]\n\n")


async def _honest(r: _Request) -> None:
    await r.stream(TOKENS, (r.prompt_tokens, TOKENS))


async def _break_after(r: _Request, line: bytes) -> None:
    await r.stream(CUT_AFTER, done=False)
    await r.send(line, r.chunk(PIECE), b"data: [DONE]\n\n")


async def _break_in_the_same_read(r: _Request, line: bytes) -> None:
    """``CUT_AFTER`` pieces and the broken line in one write: the gateway reads them together."""
    await r.head()
    await r.send(*(r.chunk(PIECE) for _ in range(CUT_AFTER)), line, r.chunk(PIECE), b"data: [DONE]\n\n")


async def _split_lines(r: _Request) -> None:
    """An honest stream whose every event is cut in two writes, mid-JSON, a moment apart: the gateway reads
    the halves apart and must join them."""
    await r.head()
    events = [r.chunk(PIECE) for _ in range(TOKENS)] + [r.chunk(None, "stop"), r.usage(r.prompt_tokens, TOKENS)]
    for event in [*events, b"data: [DONE]\n\n"]:
        half = len(event) // 2
        await r.send(event[:half])
        await asyncio.sleep(SPLIT_PAUSE_S)
        await r.send(event[half:])


async def _done_without_newline(r: _Request) -> None:
    """An honest stream whose ``[DONE]`` ends the connection with no newline after it."""
    await r.head()
    await r.send(*(r.chunk(PIECE) for _ in range(TOKENS)), r.chunk(None, "stop"), r.usage(r.prompt_tokens, TOKENS))
    await r.send(b"data: [DONE]")


async def _past_max_tokens(r: _Request, field: str = "content") -> None:
    """``PAST_MAX_TOKENS`` deltas of ``field`` (content, reasoning_content, or tool-call arguments), the finish
    and ``[DONE]`` in one write, whatever ``max_tokens`` said."""
    await r.head()
    await r.send(*(r.delta(field) for _ in range(PAST_MAX_TOKENS)), r.chunk(None, "stop"), b"data: [DONE]\n\n")


async def _late_first(r: _Request) -> None:
    """The head at once, the first pieces only ``LATE_FIRST_S`` later (a long prefill), unless the gateway
    hangs up first."""
    await r.head()
    try:
        await asyncio.wait_for(r.reader.read(), LATE_FIRST_S)
        return  # the gateway hung up: nothing to send
    except TimeoutError:
        await r.stream(TOKENS, (r.prompt_tokens, TOKENS), head=False)


async def _usage_then_stall(r: _Request) -> None:
    """A piece, the finish and a usage chunk in one write, then nothing (the gateway's idle timeout ends it)."""
    await r.head()
    await r.send(r.chunk(PIECE), r.chunk(None, "stop"), r.usage(r.prompt_tokens, 1))
    await r.stall()


async def _keepalive_only(r: _Request) -> None:
    """The head, then only SSE comments (a proxy's keep-alive) every 0.1 s until the gateway hangs up."""
    await r.head()
    for _ in range(int(STALL_S_MAX / 0.1)):
        await r.send(b": keep-alive\n\n")
        await asyncio.sleep(0.1)


async def _fan_choices(r: _Request) -> None:
    """One chunk of ``PAST_MAX_TOKENS`` choice entries, every one a piece of choice 0."""
    await r.head()
    choice = {"index": 0, "delta": {"content": PIECE}, "finish_reason": None}
    await r.send(r.data({"id": "bad-1", "object": "chunk", "choices": [choice] * PAST_MAX_TOKENS}), b"data: [DONE]\n\n")


async def _text_beside_delta(r: _Request) -> None:
    """A completion's ``TOKENS`` pieces, each ``text`` beside an empty ``delta`` object, and honest usage."""
    await r.head()
    choice = {"index": 0, "text": PIECE, "delta": {}, "finish_reason": None}
    pieces = [r.data({"id": "bad-1", "object": "text_completion", "choices": [choice]}) for _ in range(TOKENS)]
    await r.send(*pieces, r.usage(r.prompt_tokens, TOKENS), b"data: [DONE]\n\n")


async def _tools_and_reasoning(r: _Request) -> None:
    """A reasoning model calling a tool: 2 reasoning pieces, a tool call (its id and name, then 3 argument
    pieces), and honest usage (6: the name is a piece)."""
    await r.head()
    first = {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f"}}]}
    call = r.data({"id": "bad-1", "object": "chunk", "choices": [{"index": 0, "delta": first, "finish_reason": None}]})
    parts = [
        r.delta("reasoning_content"),
        r.delta("reasoning_content"),
        call,
        *(r.delta("tool_calls") for _ in range(3)),
    ]
    await r.send(*parts, r.chunk(None, "tool_calls"), r.usage(r.prompt_tokens, 6), b"data: [DONE]\n\n")


async def _one_choice_for_two(r: _Request) -> None:
    """``TOKENS`` + 4 pieces, every one for choice 0, whatever ``n`` asked."""
    await r.head()
    await r.send(*(r.chunk(PIECE) for _ in range(TOKENS + 4)), b"data: [DONE]\n\n")


async def _break_after_nothing(r: _Request, line: bytes) -> None:
    await r.head()
    await r.send(line, r.chunk(PIECE), b"data: [DONE]\n\n")


async def _stall_mid(r: _Request) -> None:
    await r.stream(CUT_AFTER, done=False)
    await r.stall()


async def _stall_first(r: _Request) -> None:
    await r.head()
    await r.stall()


async def _close_mid(r: _Request) -> None:
    """Chunked transfer encoding, cut inside the body: the client sees an incomplete message."""
    await r.head(extra="transfer-encoding: chunked\r\n")
    for _ in range(CUT_AFTER):
        piece = r.chunk(PIECE)
        await r.send(f"{len(piece):x}\r\n".encode(), piece, b"\r\n")
    # It breaks a moment later, as an engine dies between iterations: bytes still unread by the gateway when a
    # body breaks are lost with it (UpstreamClient._chunks), and the pieces are here to be received.
    await asyncio.sleep(BREAK_AFTER_S)


async def _html(r: _Request, status: str) -> None:
    await r.head(status, "text/html", f"content-length: {len(HTML)}\r\n")
    await r.send(HTML)


# mode -> what the upstream does; the ones that break mid-stream send ``CUT_AFTER`` pieces first.
MODES: dict[str, Callable[[_Request], Awaitable[None]]] = {
    "honest": _honest,
    "html_502": lambda r: _html(r, "502 Bad Gateway"),
    "html_200": lambda r: _html(r, "200 OK"),
    "garbage_first": lambda r: _break_after_nothing(r, HTML + b"\n"),
    "garbage_line": lambda r: _break_after(r, HTML + b"\n"),
    "garbage_same_read": lambda r: _break_in_the_same_read(r, HTML + b"\n"),
    "not_json_same_read": lambda r: _break_in_the_same_read(r, b'data: {"choices": [{"index": 0, "te\n\n'),
    "past_max_tokens": _past_max_tokens,
    "reasoning_past_max_tokens": lambda r: _past_max_tokens(r, "reasoning_content"),
    "tool_calls_past_max_tokens": lambda r: _past_max_tokens(r, "tool_calls"),
    "tool_calls_first": lambda r: _break_after_nothing(r, TOOL_CALLS_NOT_A_LIST),
    "tool_calls_line": lambda r: _break_after(r, TOOL_CALLS_NOT_A_LIST),
    "late_first": _late_first,
    "usage_then_stall": _usage_then_stall,
    "one_choice_for_two": _one_choice_for_two,
    "function_call_past_max_tokens": lambda r: _past_max_tokens(r, "function_call"),
    "keepalive_only": _keepalive_only,
    "fan_choices": _fan_choices,
    "text_beside_delta": _text_beside_delta,
    "tools_and_reasoning": _tools_and_reasoning,
    "usage_under": lambda r: r.stream(TOKENS, (r.prompt_tokens, TOKENS - 2)),
    "split_lines": _split_lines,
    "done_without_newline": _done_without_newline,
    "endless_line": lambda r: _break_after_nothing(r, b"data: " + b"x" * ENDLESS_LINE_BYTES + b"\n\n"),
    "data_not_json": lambda r: _break_after(r, b'data: {"choices": [{"index": 0, "te\n\n'),
    "no_choices": lambda r: _break_after(r, r.data({"id": "bad-1", "object": "chunk"})),
    "error_event": lambda r: _break_after(r, r.data({"error": {"message": "CUDA error: out of memory"}})),
    "stall_head": lambda r: r.stall(),
    "stall_first": _stall_first,
    "stall_mid": _stall_mid,
    "close_head": lambda r: asyncio.sleep(0),
    "close_mid": _close_mid,
    "eof_mid": lambda r: r.stream(CUT_AFTER, done=False),
    "usage_low": lambda r: r.stream(TOKENS, (r.prompt_tokens, 1)),
    "usage_high": lambda r: r.stream(TOKENS, (r.prompt_tokens, 1000)),
    "usage_prompt_zero": lambda r: r.stream(TOKENS, (0, TOKENS)),
    "usage_slack": lambda r: r.stream(TOKENS, (r.prompt_tokens + 5, TOKENS + 3)),
}


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, dict[str, Any]]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    path = head.split(" ", 2)[1]
    length = next(
        (int(line.split(":", 1)[1]) for line in head.split("\r\n") if line.lower().startswith("content-length:")), 0
    )
    return path, json.loads(await reader.readexactly(length) or b"{}")


def _prompt(body: dict[str, Any]) -> str:
    if "messages" in body:
        content = body["messages"][-1].get("content")
        return content if isinstance(content, str) else ""
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else ""


@dataclass
class BadUpstream:
    """A running misbehaving upstream (see module docstring)."""

    url: str = ""
    modes: list[str] = field(default_factory=list)
    _open: set[asyncio.StreamWriter] = field(default_factory=set)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer one request on one connection, as its mode says, then close the connection."""
        self._open.add(writer)
        try:
            path, body = await _read_request(reader)
            words = _prompt(body).split()
            mode = words[0] if words and words[0] in MODES else "honest"
            self.modes.append(mode)
            chat = path.endswith("/chat/completions")
            prompt_tokens = len(words) + (CHAT_MESSAGE_OVERHEAD_TOKENS if chat else 0)
            await MODES[mode](_Request(chat, mode, prompt_tokens, writer, reader))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the gateway hung up: nothing to answer
        finally:
            self._open.discard(writer)
            writer.close()

    def hang_up(self) -> None:
        """Close every connection still open (a stall the gateway never hung up on)."""
        for writer in list(self._open):
            writer.close()


@contextmanager
def serve_bad_upstream() -> Iterator[BadUpstream]:
    """Run a ``BadUpstream`` on 127.0.0.1 (a free port) on a thread until the block ends.

    Raises:
        RuntimeError: it did not start within ``STARTUP_S_MAX``.
    """
    upstream, started, loop = BadUpstream(), threading.Event(), asyncio.new_event_loop()
    stop = loop.create_future()

    async def run() -> None:
        server = await asyncio.start_server(upstream.handle, "127.0.0.1", 0)
        upstream.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        started.set()
        async with server:
            await stop
            server.close()
            upstream.hang_up()

    thread = threading.Thread(target=loop.run_until_complete, args=(run(),), daemon=True, name="bad-upstream")
    thread.start()
    if not started.wait(STARTUP_S_MAX):
        raise RuntimeError("the misbehaving upstream did not start")
    try:
        yield upstream
    finally:
        loop.call_soon_threadsafe(stop.set_result, None)
        thread.join(timeout=30)
        loop.close()


__all__ = ["MODES", "PIECE", "TOKENS", "BadUpstream", "serve_bad_upstream"]
