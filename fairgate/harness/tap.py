"""A tap on an in-process emulated replica: which generation requests reached it and what it generated for
each, so a drill can compare what a client received and the ledger billed with what the replica did.

A request is known by a tag: the last word of its last message (or of its prompt). The load generator puts
the request id there (``Request.tag``).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import time
from typing import Any

from fairgate.emulator.api import replica_of

_TAG: contextvars.ContextVar[str | None] = contextvars.ContextVar("fairgate_tap_tag", default=None)


class EmulatorTap:
    """ASGI wrapper of an in-process emulated replica: maps each generation request to the replica's
    ``Sequence`` by a tag, the last word of the request's last message (or prompt).

    ``sequences``: tag -> every sequence submitted under it (more than one would be a request run twice);
    ``bodies``: tag -> the body of every generation request received under it, as parsed JSON.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self.sequences: dict[str, list[Any]] = {}
        self.bodies: dict[str, list[Any]] = {}
        self.untagged = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        pieces: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                await self.app(scope, _replay([message], receive), send)
                return
            pieces.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        raw = b"".join(pieces)
        tag = _tag_of(raw)
        if tag is not None:
            self.bodies.setdefault(tag, []).append(json.loads(raw))
        token = _TAG.set(tag)
        try:
            await self.app(scope, _replay([{"type": "http.request", "body": raw, "more_body": False}], receive), send)
        finally:
            _TAG.reset(token)

    def attach(self) -> None:
        """Wrap the replica's ``submit`` (call once the app has started: the replica exists then)."""
        replica = replica_of(self.app)
        original = replica.submit

        def submit(
            prompt_tokens: int, output_tokens: int, cache_salt: str | None = None, prompt_blocks: tuple[int, ...] = ()
        ) -> Any:
            seq = original(prompt_tokens, output_tokens, cache_salt, prompt_blocks)
            seq.events = _TimedQueue()  # nothing is in it yet: records when each token is generated
            tag = _TAG.get()
            if tag is None:
                self.untagged += 1
            else:
                self.sequences.setdefault(tag, []).append(seq)
            return seq

        original_cancel = replica.cancel

        def cancel(seq: Any) -> None:
            if not seq.finished and not seq.cancelled:
                seq.cancelled_at_s = time.monotonic()  # when the hang-up reached the replica
            original_cancel(seq)

        # Wrapped in place: the replica serves on this process's thread, and its routes call these methods.
        replica.submit = submit  # type: ignore[method-assign]
        replica.cancel = cancel  # type: ignore[method-assign]

    @property
    def replica(self) -> Any:
        return replica_of(self.app)


class _TimedQueue(asyncio.Queue):  # type: ignore[type-arg]
    """A sequence's token queue that notes when each token was generated (``token_s``, monotonic)."""

    def __init__(self) -> None:
        super().__init__()
        self.token_s: list[float] = []

    def put_nowait(self, item: Any) -> None:
        if item is not None:
            self.token_s.append(time.monotonic())
        super().put_nowait(item)


def _replay(messages: list[dict[str, Any]], receive: Any) -> Any:
    pending = list(messages)

    async def replayed() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        message: dict[str, Any] = await receive()
        return message

    return replayed


def _tag_of(raw: bytes) -> str | None:
    try:
        body = json.loads(raw)
        content = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
        words = content.split() if isinstance(content, str) else []
        return words[-1] if words else None
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None


__all__ = ["EmulatorTap"]
