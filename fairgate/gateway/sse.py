"""Reading an upstream's server-sent events strictly: what a line of the stream is, and whether a chunk is
one the gateway can relay and meter.

An OpenAI-compatible stream is lines of ``data: <JSON object>`` separated by blank lines, ending with
``data: [DONE]``; the SSE standard also allows comments (``:...``) and the fields ``event``, ``id`` and
``retry``, which carry nothing the gateway uses. Anything else - an HTML page, a proxy's banner, a
truncated line - means the stream is not what the upstream claims, and relaying on (or billing what the
gateway cannot read) would charge the tenant for garbage: the call fails instead (``MalformedStream``).
"""

from __future__ import annotations

from typing import Any

import orjson

DONE = "[DONE]"
SAMPLE_CHARS = 200
_IGNORED_FIELDS = ("event", "id", "retry")
_GENERATED_TEXT = ("content", "reasoning_content", "reasoning", "refusal")
_TEXT_FIELDS = ("text", *_GENERATED_TEXT)

# The keys of a choice that carries nothing but plain generated text (``plain_text``): a completion's, a chat
# chunk's (its delta: ``_PLAIN_DELTA``), and fields no count reads (vLLM's ``stop_reason``, SGLang's
# ``matched_stop``).
_PLAIN_COMPLETION = frozenset(("index", "text", "finish_reason", "logprobs", "stop_reason", "matched_stop"))
_PLAIN_CHAT = frozenset(("index", "delta", "finish_reason", "logprobs", "stop_reason", "matched_stop"))
_PLAIN_DELTA = frozenset(("role", "content"))


class MalformedStream(ValueError):
    """The upstream's stream broke the SSE framing or sent a chunk that is not an OpenAI chunk: the message
    says what (for the client too); ``sample`` quotes up to ``SAMPLE_CHARS`` of what was sent (for the log
    only: a proxy's page may name hosts the client has no business seeing)."""

    def __init__(self, message: str, sample: str) -> None:
        super().__init__(message)
        self.sample = sample[:SAMPLE_CHARS]


def data_of(line: str) -> str | None:
    """The payload of one stream line: its ``data`` field (``[DONE]`` included), or None for a line that
    carries nothing (blank, comment, ``event``/``id``/``retry``). Raises ``MalformedStream`` for any other
    line."""
    if not line.strip() or line.startswith(":"):
        return None
    name, colon, value = line.partition(":")
    if colon and name == "data":
        return value[1:] if value.startswith(" ") else value  # one space after the colon is framing
    if colon and name in _IGNORED_FIELDS:
        return None
    raise MalformedStream("a line that is not server-sent events", line)


def chunk_of(data: str) -> dict[str, Any]:
    """The chunk a ``data`` payload holds: a JSON object with a ``choices`` list of objects, or with a
    ``usage`` object (the final usage chunk may leave ``choices`` out). Raises ``MalformedStream``: not
    JSON, not such an object, or an ``error`` object the upstream sent mid-stream."""
    try:
        chunk = orjson.loads(data)  # strict JSON: no NaN, no integer past 64 bits (the relay re-encodes it)
    except orjson.JSONDecodeError:
        raise MalformedStream("a data line that is not JSON", data) from None
    return _checked(chunk, data)


def line_chunk(line: bytes) -> dict[str, Any] | None:
    """The chunk of the common stream line, ``data: {...}`` (its newline taken off), read from its bytes as
    they came: what ``chunk_of(data_of(line))`` returns, without decoding the line first (a twentieth of the
    gateway's CPU per relayed token went to decoding and splitting it). None for any other line, and for one
    that does not parse as it is (not UTF-8 or not JSON): the caller reads those as ``data_of`` and
    ``chunk_of`` do. Raises ``MalformedStream`` as ``chunk_of`` does for a JSON object that is no chunk."""
    if not (line.startswith(b"data: {") and line.endswith(b"}")):
        return None
    try:
        chunk = orjson.loads(line[6:])
    except orjson.JSONDecodeError:
        return None
    return _checked(chunk, line)


def _checked(chunk: object, data: str | bytes) -> dict[str, Any]:
    """``chunk`` (parsed from ``data``) when it is a chunk the gateway can relay and meter (``chunk_of``);
    raises ``MalformedStream``."""
    if not isinstance(chunk, dict):
        raise MalformedStream("a chunk that is not a JSON object", _text(data))
    if chunk.get("error") is not None or chunk.get("object") == "error":
        error = chunk.get("error")
        message = error.get("message") if isinstance(error, dict) else chunk.get("message", error)
        raise MalformedStream(f"an error mid-stream: {str(message)[:SAMPLE_CHARS]}", _text(data))
    choices = chunk.get("choices")
    if choices is None and isinstance(chunk.get("usage"), dict):
        return chunk
    if not isinstance(choices, list) or not all(map(_is_choice, choices)):
        raise MalformedStream("a chunk without a choices list of choice objects", _text(data))
    return chunk


def _text(data: str | bytes) -> str:
    """A line's text for a ``MalformedStream`` sample: a data payload, or a whole line read as bytes less its
    ``data: `` (the payload ``data_of`` would give)."""
    return data if isinstance(data, str) else data[6:].decode(errors="replace")


def _is_choice(choice: object) -> bool:
    """An object whose ``delta`` (if any) is an object and whose text fields are strings or null, and whose
    ``tool_calls`` (if any) are what ``generated_bytes`` can read."""
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    # The common choices (``plain_text``) have only their text to check.
    if delta is None and choice.keys() <= _PLAIN_COMPLETION:
        return isinstance(choice.get("text"), (str, type(None)))
    if type(delta) is dict and choice.keys() <= _PLAIN_CHAT and delta.keys() <= _PLAIN_DELTA:
        return isinstance(delta.get("content"), (str, type(None)))
    text = choice.get("text")
    if text is not None and not isinstance(text, str):
        return False
    if delta is not None and not isinstance(delta, dict):
        return False
    source = choice if delta is None else delta
    for name in _GENERATED_TEXT:  # a loop that stops early: this runs for every chunk relayed
        value = source.get(name)
        if value is not None and not isinstance(value, str):
            return False
    return _are_tool_calls(source.get("tool_calls")) and _is_function(source.get("function_call"))


def _is_function(function: object) -> bool:
    """Null, or an object with string-or-null ``name`` and ``arguments`` (a tool call's, or OpenAI's older
    ``function_call``)."""
    if function is None:
        return True
    if not isinstance(function, dict):
        return False
    return not any(v is not None and not isinstance(v, str) for v in (function.get("name"), function.get("arguments")))


def _are_tool_calls(calls: object) -> bool:
    """Null, or a list of objects whose ``function`` (if any) is an object with string-or-null ``name`` and
    ``arguments``."""
    if calls is None:
        return True
    if not isinstance(calls, list):
        return False
    return all(isinstance(call, dict) and _is_function(call.get("function")) for call in calls)


def generated_bytes(choice: dict[str, Any]) -> int:
    """UTF-8 bytes of the text one chunk's choice generated, in any field (completion text, content,
    reasoning, refusal, tool-call and function-call names and arguments): the ceiling of the tokens it can
    have taken (every token of a byte-level tokenizer decodes to at least one byte; special tokens are the
    usage rule's slack)."""
    delta = choice.get("delta")
    source = delta if isinstance(delta, dict) else choice
    total = 0
    for name in _TEXT_FIELDS:
        piece = source.get(name)
        if isinstance(piece, str):
            total += len(piece) if piece.isascii() else len(piece.encode("utf-8"))
    if source is not choice and isinstance(text := choice.get("text"), str):  # a completion's text beside a delta
        total += len(text.encode("utf-8"))
    # Their shapes are checked (``chunk_of``): tool calls, and OpenAI's older ``function_call``.
    functions = [call.get("function") or {} for call in source.get("tool_calls") or ()]
    for function in [*functions, source.get("function_call") or {}]:
        for piece in (function.get("name"), function.get("arguments")):
            if piece:
                total += len(piece.encode("utf-8"))
    return total


def plain_text(choice: dict[str, Any]) -> str | None:
    """The text a checked choice (``chunk_of``) generated when it carries nothing else that is counted or kept
    (no reasoning, refusal, tool or function call): a completion's ``text`` or a chat delta's ``content``,
    "" when null. None for any other choice: its text is read field by field (``generated_bytes``)."""
    delta = choice.get("delta")
    if delta is None:
        if choice.keys() <= _PLAIN_COMPLETION:
            return choice.get("text") or ""
        return None
    if type(delta) is dict and choice.keys() <= _PLAIN_CHAT and delta.keys() <= _PLAIN_DELTA:
        return delta.get("content") or ""
    return None
