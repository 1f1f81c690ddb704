"""``ReadAhead``: an upstream stream read by a task of its own while its caller waits on something else."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from fairgate.gateway.readahead import ClientStalled, ReadAhead
from fairgate.gateway.upstream import BudgetSpent, CallState


class Upstream:
    """A stream of ``reads`` upstream reads (lists of chunk numbers) ``gap_s`` apart, as ``UpstreamClient.stream``
    yields them (``call.more_buffered`` set within a read); records when each chunk was read and how it ended."""

    def __init__(self, reads: list[list[int]], gap_s: float = 0.0, fail: Exception | None = None) -> None:
        self.reads, self.gap_s, self.fail = reads, gap_s, fail
        self.call = CallState("r", "t", 1)
        self.read_at: dict[int, float] = {}
        self.ended: str | None = None

    async def stream(self) -> AsyncGenerator[dict[str, Any], None]:
        loop = asyncio.get_running_loop()
        try:
            for read in self.reads:
                await asyncio.sleep(self.gap_s)
                for i, number in enumerate(read):
                    self.read_at[number] = loop.time()
                    self.call.more_buffered = i < len(read) - 1
                    yield {"n": number}
            if self.fail is not None:
                raise self.fail
            self.ended = "done"
        except (GeneratorExit, asyncio.CancelledError):
            self.ended = "cut"
            raise


async def _take(ahead: ReadAhead, count: int) -> list[tuple[int, bool]]:
    """The next ``count`` chunks' numbers, each with ``ahead.more`` after it."""
    out = []
    for _ in range(count):
        chunk = await ahead.__anext__()
        out.append((chunk["n"], ahead.more))
    return out


def test_chunks_come_in_order_and_more_tells_what_is_already_here() -> None:
    async def run() -> tuple[list[tuple[int, bool]], str | None]:
        upstream = Upstream([[1, 2, 3], [4], [5, 6]], gap_s=0.01)
        ahead = ReadAhead(upstream.stream(), upstream.call)
        first = await _take(ahead, 3)  # one read: the first two have another behind them
        rest = [(chunk["n"], ahead.more) async for chunk in ahead]
        return first + rest, upstream.ended

    chunks, ended = asyncio.run(run())
    assert [n for n, _ in chunks] == [1, 2, 3, 4, 5, 6]
    assert [more for _, more in chunks][:3] == [True, True, False]
    assert chunks[4] == (5, True) and chunks[5] == (6, False)
    assert ended == "done"


def test_the_stream_is_read_while_the_caller_waits() -> None:
    async def run() -> tuple[float, float]:
        upstream = Upstream([[n] for n in range(1, 11)], gap_s=0.02)
        ahead = ReadAhead(upstream.stream(), upstream.call)
        await ahead.__anext__()
        await asyncio.sleep(0.5)  # the caller waits (a ledger call): the upstream's chunks are read meanwhile
        loop = asyncio.get_running_loop()
        taken_at = loop.time()
        rest = [chunk["n"] async for chunk in ahead]
        assert rest == list(range(2, 11))
        return upstream.read_at[10], taken_at

    last_read_at, taken_at = asyncio.run(run())
    assert last_read_at < taken_at - 0.2  # read when it came (~0.2 s in), not when the caller asked (0.5 s)


def test_what_the_stream_raises_comes_after_the_chunks_read_before_it() -> None:
    async def run() -> tuple[list[int], BaseException | None]:
        upstream = Upstream([[1, 2], [3]], fail=BudgetSpent("max_tokens_exceeded", "past max_tokens"))
        ahead = ReadAhead(upstream.stream(), upstream.call)
        seen: list[int] = []
        try:
            async for chunk in ahead:
                seen.append(chunk["n"])
        except BudgetSpent as exc:
            return seen, exc
        return seen, None

    seen, raised = asyncio.run(run())
    assert seen == [1, 2, 3]
    assert isinstance(raised, BudgetSpent) and raised.code == "max_tokens_exceeded"


@pytest.mark.parametrize("reads_max", [1, 1024])
def test_aclose_cuts_the_stream_wherever_its_reader_is(reads_max: int) -> None:
    """Closed mid-stream: the upstream stream is cut (the meter takes the call as cut), whether the reading task
    waits on the upstream (room in the queue) or on the caller (queue full)."""

    async def run() -> tuple[str | None, int]:
        upstream = Upstream([[n] for n in range(1, 101)], gap_s=0.005)
        ahead = ReadAhead(upstream.stream(), upstream.call, reads_max=reads_max)
        await _take(ahead, 2)
        await asyncio.sleep(0.05)
        await ahead.aclose()
        assert [chunk async for chunk in ahead] == []  # nothing more once closed
        return upstream.ended, len(upstream.read_at)

    ended, read = asyncio.run(run())
    assert ended == "cut"
    assert read < 100
    if reads_max == 1:  # the reader waited for room: at most the queued read and the one it holds past the taken two
        assert read <= 4


def test_aclose_before_anything_was_asked_closes_the_stream_unsent() -> None:
    async def run() -> tuple[str | None, int]:
        upstream = Upstream([[1]])
        ahead = ReadAhead(upstream.stream(), upstream.call)
        await ahead.aclose()
        return upstream.ended, len(upstream.read_at)

    assert asyncio.run(run()) == (None, 0)  # never started: nothing sent upstream


def test_the_upstreams_end_is_told_when_it_comes_not_when_the_caller_has_taken_it_all() -> None:
    async def run() -> tuple[list[float], float, float]:
        loop = asyncio.get_running_loop()
        upstream, ended_at = Upstream([[1], [2], [3]], gap_s=0.01), []
        ahead = ReadAhead(upstream.stream(), upstream.call, on_end=lambda: ended_at.append(loop.time()))
        await ahead.__anext__()
        await asyncio.sleep(0.3)  # the caller waits: the upstream ends meanwhile (its slot is free from then)
        taken_at = loop.time()
        assert [chunk["n"] async for chunk in ahead] == [2, 3]
        await ahead.aclose()
        return ended_at, taken_at, upstream.read_at[3]

    ended_at, taken_at, last_read_at = asyncio.run(run())
    assert len(ended_at) == 1 and last_read_at <= ended_at[0] < taken_at - 0.2


def test_a_caller_that_takes_nothing_for_stall_s_with_the_read_ahead_full_has_the_upstream_cut() -> None:
    """A client that stopped reading: the upstream is cut ``stall_s`` after the read-ahead filled (the meter takes
    the call off then, and its slot is free); every chunk read is still handed out, then ``ClientStalled``."""

    async def run() -> tuple[list[int], int, str | None, float]:
        loop = asyncio.get_running_loop()
        upstream, ended_at = Upstream([[n] for n in range(1, 201)], gap_s=0.002), []
        on_end = lambda: ended_at.append(loop.time())
        ahead = ReadAhead(upstream.stream(), upstream.call, reads_max=8, stall_s=0.3, on_end=on_end)
        await ahead.__anext__()
        stopped_taking_at = loop.time()
        await asyncio.sleep(1.0)
        rest: list[int] = []
        with pytest.raises(ClientStalled, match=r"read nothing for 0\.3 s"):
            async for chunk in ahead:
                rest.append(chunk["n"])
        return rest, len(upstream.read_at), upstream.ended, ended_at[0] - stopped_taking_at

    rest, read, ended, cut_after_s = asyncio.run(run())
    assert ended == "cut" and read < 20  # 8 queued, one held, one in the waiting put: the rest never generated
    assert rest == list(range(2, read + 1))
    assert 0.3 <= cut_after_s < 0.6
