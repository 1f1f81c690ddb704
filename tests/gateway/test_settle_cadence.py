"""A stream is settled as it runs, every ``SETTLE_EVERY_TOKENS`` tokens or ``SETTLE_EVERY_S``, whichever comes
first: a gateway killed mid-stream (nothing after it settles the stream) leaves at most that much of what its
clients received unbilled. Read off the ledger's own event log, per settlement."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import httpx

from fairgate.emulator.api import create_app
from fairgate.gateway.call import SETTLE_EVERY_S, SETTLE_EVERY_TOKENS
from fairgate.ledger.model import Event
from tests.gateway.conftest import serve_stack, slower


def _stream(url: str, key: str, max_tokens: int) -> int:
    """Stream a completion of exactly ``max_tokens`` tokens; the text pieces the client received."""
    body = {"model": "emu", "prompt": "x", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    return sum(1 for c in chunks if c.get("choices") and c["choices"][0].get("text"))


def _settlements(events: list[Event]) -> list[tuple[float, int]]:
    """(ledger time ms, cumulative output tokens billed) after the reservation and each of its settlements."""
    billed, out = 0, []
    for e in sorted(events, key=lambda e: e.seq):
        billed += e.output_tokens
        out.append((e.at_ms, billed))
    return out


def test_a_fast_stream_is_settled_every_64_tokens(tmp_path: Path) -> None:
    """300 tokens at ~4 ms an iteration: 64 tokens come well inside ``SETTLE_EVERY_S``, so the token bound is the
    one that settles; no two consecutive bookings are further apart than it."""
    with serve_stack(tmp_path) as stack:
        received = _stream(stack.url, stack.keys["alpha"], 300)
        [r] = stack.reservations()
        events = stack.ledger_call(lambda ledger: ledger.events("alpha"))
    booked = _settlements(events)
    assert received == 300 and r.billed.output_tokens == 300 and booked[-1][1] == 300, (received, r, booked)
    gaps = [b - a for (_, a), (_, b) in itertools.pairwise(booked)]
    assert max(gaps) <= SETTLE_EVERY_TOKENS, booked
    assert len(booked) >= 1 + 300 // SETTLE_EVERY_TOKENS, booked


def test_a_slow_stream_is_settled_every_half_second(tmp_path: Path) -> None:
    """A replica 30x slower (~130 ms an iteration): 64 tokens would take 8 s, so the time bound settles; the
    ledger books the stream at least every ``SETTLE_EVERY_S`` plus one iteration (the checkpoint runs when a
    token arrives)."""
    replica = slower(30.0)
    iteration_ms = replica.iter_base_ms + replica.iter_slope_ms
    with serve_stack(tmp_path, create_app(replica.settings("emu"))) as stack:
        received = _stream(stack.url, stack.keys["alpha"], 24)
        events = stack.ledger_call(lambda ledger: ledger.events("alpha"))
    booked = _settlements(events)
    assert received == 24 and booked[-1][1] == 24, (received, booked)
    times = [at for at, _ in booked[1:-1]]  # the first token's booking, then each partial one
    assert len(times) >= 4, booked
    assert max(b - a for a, b in itertools.pairwise(times)) <= SETTLE_EVERY_S * 1000 + 2 * iteration_ms, booked
