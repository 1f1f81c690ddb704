"""The relay's fast paths do what the general ones do: the common line read from its bytes
(``sse.line_chunk``), the common choice accepted at a glance (``sse._is_choice``) and its text counted,
kept, metered and booked with fewer calls (``UpstreamClient._observe_plain``)."""

from __future__ import annotations

import itertools
from typing import Any

import orjson
import pytest

from fairgate.core.cost import CostModel
from fairgate.gateway import sse
from fairgate.gateway.dispatch import Upstream
from fairgate.gateway.upstream import BudgetSpent, CallState, UpstreamClient, UpstreamError

COST = CostModel(9.0, 0.55, 0.06, 24)

CHOICES: list[dict[str, Any]] = [
    {"index": 0, "text": " t1", "finish_reason": None, "logprobs": None},
    {"index": 0, "text": "", "finish_reason": "length", "logprobs": None, "stop_reason": None},
    {"index": 0, "text": None, "finish_reason": None},
    {"index": 0, "text": "héllo ✓", "finish_reason": None},
    {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None},
    {"index": 0, "delta": {"content": " world"}, "finish_reason": None, "matched_stop": None},
    {"index": 0, "delta": {"content": None}, "finish_reason": "stop"},
    {"index": 0, "delta": {}, "finish_reason": "stop"},
    {"index": 0, "delta": {"reasoning_content": "hm"}, "finish_reason": None},
    {"index": 0, "delta": {"content": "a", "reasoning": "b"}},
    {"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": "{"}}]}},
    {"index": 0, "delta": {"function_call": {"name": "f", "arguments": "{}"}}},
    {"index": 0, "delta": {"refusal": "no"}},
    {"index": 0, "delta": {"content": "x"}, "text": "y"},
    {"index": 0, "delta": None, "text": "z"},
    {"index": 0, "text": "a", "reasoning_content": "b"},
    {"index": 0, "text": "a", "extra": {"anything": 1}},
]
# Choices a chunk may not hold: the fast check must refuse them as the full one does.
BAD_CHOICES: list[object] = [
    {"index": 0, "text": 5},
    {"index": 0, "text": ["a"]},
    {"index": 0, "delta": {"content": 5}},
    {"index": 0, "delta": {"content": {"a": 1}}, "finish_reason": None},
    {"index": 0, "delta": "text"},
    {"index": 0, "delta": {"tool_calls": [{"function": {"arguments": 3}}]}},
    "text",
    None,
]


def _line(chunk: object) -> bytes:
    return b"data: " + orjson.dumps(chunk)


def _slow(line: bytes) -> dict[str, Any] | None:
    data = sse.data_of(line.decode(errors="replace").rstrip("\r"))
    return None if data is None or data.strip() == sse.DONE else sse.chunk_of(data)


@pytest.mark.parametrize("choice", CHOICES + BAD_CHOICES)
def test_a_line_read_from_its_bytes_is_the_chunk_read_from_its_text(choice: object) -> None:
    line = _line({"id": "x", "object": "text_completion", "model": "emu", "choices": [choice]})
    try:
        expected: object = _slow(line)
    except sse.MalformedStream as exc:
        expected = (str(exc), exc.sample)
    try:
        got: object = sse.line_chunk(line)
    except sse.MalformedStream as exc:
        got = (str(exc), exc.sample)
    assert got == expected


@pytest.mark.parametrize(
    "line",
    [
        b"data: [DONE]",
        b"data:{}",
        b": keep-alive",
        b"",
        b'data: {"choices": []}\r',
        b"data: {not json}",
        b'data: {"choices": [{"text": "\xff"}]}',
        b"event: ping",
        b"data: [1, 2]",
    ],
)
def test_any_other_line_is_left_to_the_general_reading(line: bytes) -> None:
    assert sse.line_chunk(line) is None


@pytest.mark.parametrize(
    "chunk",
    [
        {"error": {"message": "boom"}},
        {"object": "error", "message": "boom"},
        {"usage": {"prompt_tokens": 1}},
        {"choices": "no"},
    ],
)
def test_an_error_or_odd_object_read_from_bytes_fails_or_passes_as_from_text(chunk: object) -> None:
    line = _line(chunk)
    outcomes: list[object] = []
    for read in (_slow, sse.line_chunk):
        try:
            outcomes.append(read(line))
        except sse.MalformedStream as exc:
            outcomes.append((str(exc), exc.sample))
    assert outcomes[0] == outcomes[1]


class _Clock:
    """A clock that moves 1 ms each reading: both paths read it the same number of times."""

    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        self.now_s += 0.001
        return self.now_s


async def _run(chunks: list[dict[str, Any]], max_tokens: int | None, fast: bool) -> tuple[Any, ...]:
    """The call's state and the charges booked after ``chunks``, observed with the fast path or not."""
    booked: list[tuple[Any, ...]] = []
    client = UpstreamClient(
        Upstream("emu-0", "emu", "http://127.0.0.1:1/v1", 24, COST), lambda *args: booked.append(args), clock=_Clock()
    )
    call = CallState("r1", "t", 10, max_output_tokens=max_tokens, started_s=0.0)
    client.meter.start(call.request_id, call.tenant, call.prompt_tokens, client._now_ms())
    stopped = None
    try:
        for i, chunk in enumerate(chunks):
            call.more_buffered = i % 3 == 1  # some chunks come two to a read
            if fast:
                client._observe(call, orjson.loads(orjson.dumps(chunk)))
            else:
                original, sse.plain_text = sse.plain_text, lambda choice: None
                try:
                    client._observe(call, orjson.loads(orjson.dumps(chunk)))
                finally:
                    sse.plain_text = original
    except (BudgetSpent, UpstreamError) as exc:
        stopped = (type(exc).__name__, str(exc))
    finally:
        await client.close()
    return call, booked, stopped


@pytest.mark.parametrize("max_tokens", [None, 3, 40])
@pytest.mark.parametrize("seed", range(6))
async def test_the_common_chunk_is_observed_as_any_chunk(max_tokens: int | None, seed: int) -> None:
    pool = [*CHOICES, *CHOICES[:6], *CHOICES[:6]]  # mostly the common ones
    order = list(itertools.islice(itertools.cycle(pool), seed, seed + 30))[:: (seed % 3) + 1]
    chunks: list[dict[str, Any]] = [{"id": "x", "model": "emu", "choices": [choice]} for choice in order]
    chunks.insert(seed, {"id": "x", "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 4}})
    chunks.append({"id": "x", "choices": [CHOICES[0], CHOICES[1]]})  # two choices for one asked: refused
    fast, slow = await _run(chunks, max_tokens, True), await _run(chunks, max_tokens, False)
    assert fast == slow
    assert fast[0].output_tokens > 0


@pytest.mark.parametrize("chat", [False, True])
async def test_the_common_chunk_past_max_tokens_is_stopped_as_any_chunk(chat: bool) -> None:
    choice: dict[str, Any] = {"index": 0, "delta": {"content": "ab"}} if chat else {"index": 0, "text": "ab"}
    chunks = [{"id": "x", "choices": [choice]} for _ in range(10)]
    fast, slow = await _run(chunks, 3, True), await _run(chunks, 3, False)
    assert fast == slow
    assert fast[0].output_tokens == 3 and fast[0].texts == {0: ["ab"] * 3}
    assert fast[2] == ("BudgetSpent", "The upstream generated past max_tokens 3.")
