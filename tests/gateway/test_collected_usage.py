"""A collected (non-streamed) answer's ``usage`` is what the ledger billed, as a stream's last usage event is,
whatever the upstream reported: a count capped at ``max_tokens``, or not believed, is answered as billed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.conftest import serve_stack
from tests.gateway.test_upstream_usage import replica_reporting


def _collected(stack: Any, max_tokens: int) -> httpx.Response:
    body = {"model": "emu", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": max_tokens}
    headers = {"Authorization": f"Bearer {stack.keys['alpha']}"}
    return httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers=headers, timeout=30)


@pytest.mark.parametrize(
    ("reported", "why"),
    [
        ({"prompt_tokens": 40, "completion_tokens": 7}, "output above max_tokens (3): billed 3"),
        ({"prompt_tokens": 0, "completion_tokens": 3}, "a prompt of 0 tokens: not believed, the estimate is billed"),
    ],
)
def test_a_collected_answer_says_what_was_billed(tmp_path: Path, reported: dict[str, int], why: str) -> None:
    with serve_stack(tmp_path, replica_reporting(reported)) as stack:
        reply = _collected(stack, max_tokens=3)
        [r] = stack.reservations()
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    billed = r.billed
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (billed.input_tokens, billed.output_tokens), why
    assert usage["total_tokens"] == billed.input_tokens + billed.output_tokens and billed.output_tokens == 3, why
    assert billed.input_tokens == (40 if reported["prompt_tokens"] else r.input_tokens) > 0, (why, r)
