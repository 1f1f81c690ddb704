"""A GPU budget is a hard bound. The reservation holds the most the cost model can charge a request (a batch
of one), and a request that has used that much is stopped once its tenant's budget has nothing left, so the
overspend is at most one settlement interval. The replica here is four times slower than the cost model the
gateway was given (a miscalibrated engine), so the estimates are too low and only the stop holds the budget.
What each client received is compared with what the ledger billed, per request id."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from fairgate.emulator.api import create_app
from fairgate.gateway.call import SETTLE_EVERY_S
from fairgate.ledger import Reservation
from fairgate.ledger.config import LimitsConfig
from tests.gateway.conftest import REPLICA, Stack, serve_stack, slower

SLOW = slower(4.0)
BUDGET_S = 2.0
MAX_TOKENS = 200  # estimate 200 x 4.25 ms = 0.85 s each: two fit the budget; the slow replica bills ~1.8 s each


def _budget(tmp_path: Path, gpu_seconds: float = BUDGET_S):  # type: ignore[no-untyped-def]
    limits = LimitsConfig(gpu_seconds=gpu_seconds, gpu_window_s=3600)
    return serve_stack(tmp_path, upstream=create_app(SLOW.settings("emu")), limits={"alpha": limits})


def _stream(url: str, key: str, request_id: str) -> tuple[int, str | None]:
    """One streamed completion with the openai client: (tokens received, the terminal error's code)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    received = 0
    try:
        stream = client.completions.create(
            model="emu",
            prompt="x",
            max_tokens=MAX_TOKENS,
            stream=True,
            extra_body={"ignore_eos": True},
            extra_headers={"X-Request-Id": request_id},
        )
        for chunk in stream:
            received += sum(1 for c in chunk.choices if c.text)
    except openai.APIError as exc:
        return received, (exc.body or {}).get("code") if isinstance(exc.body, dict) else None
    return received, None


def _two_streams(stack: Stack) -> tuple[dict[str, tuple[int, str | None]], dict[str, Reservation]]:
    """Two of alpha's streams at once (``_stream``, request ids ``s0`` and ``s1``): what each received, by
    request id, and the ledger's reservations by request id once both ended."""
    key = stack.keys["alpha"]

    async def both() -> list[tuple[int, str | None]]:
        return list(await asyncio.gather(*(asyncio.to_thread(_stream, stack.url, key, f"s{i}") for i in range(2))))

    outcomes = dict(zip(("s0", "s1"), asyncio.run(both()), strict=True))
    return outcomes, {r.request_id: r for r in stack.reservations()}


def test_two_streams_on_a_slow_replica_stop_when_the_gpu_budget_is_spent(tmp_path: Path) -> None:
    with _budget(tmp_path) as stack:
        outcomes, reservations = _two_streams(stack)
    assert all(code == "gpu_budget_exhausted" for _, code in outcomes.values()), outcomes
    billed_ms = sum(r.billed.gpu_ms for r in reservations.values())
    # Without the stop both run to 200 tokens, ~3.6 s billed. With it: the budget, plus at most one settlement
    # interval of the replica's time (the charges of an interval add up to its busy time), plus the ledger
    # round trips of the two checks (200 ms: 2,600.5 was seen with 100 on a loaded 2-core machine).
    assert BUDGET_S * 1000.0 <= billed_ms <= (BUDGET_S + SETTLE_EVERY_S) * 1000.0 + 200.0, billed_ms
    for request_id, (received, _) in outcomes.items():
        r = reservations[request_id]
        assert r.status == "settled" and 0 < received < MAX_TOKENS, (r, received)
        assert r.billed.output_tokens == received, (r, received)


def test_a_collected_request_stopped_for_its_budget_ends_with_finish_reason_length(tmp_path: Path) -> None:
    with _budget(tmp_path, gpu_seconds=1.0) as stack:
        reply = httpx.post(
            f"{stack.url}/v1/completions",
            json={"model": "emu", "prompt": "x", "max_tokens": MAX_TOKENS, "ignore_eos": True},
            headers={"Authorization": f"Bearer {stack.keys['alpha']}", "X-Request-Id": "c1"},
            timeout=30.0,
        )
        [r] = stack.reservations()
    assert reply.status_code == 200 and reply.headers["x-fairgate-stop-reason"] == "gpu_budget_exhausted"
    document = reply.json()
    assert document["choices"][0]["finish_reason"] == "length"
    received = document["usage"]["completion_tokens"]
    assert 0 < received < MAX_TOKENS and r.billed.output_tokens == received, (document["usage"], r)
    assert 1000.0 <= r.billed.gpu_ms <= (1.0 + SETTLE_EVERY_S) * 1000.0 + 100.0, r


@pytest.mark.parametrize("max_tokens", [100, 1000])
def test_a_request_whose_worst_case_exceeds_the_budget_is_refused_before_it_runs(
    tmp_path: Path, max_tokens: int
) -> None:
    with _budget(tmp_path, gpu_seconds=0.5) as stack:
        reply = httpx.post(
            f"{stack.url}/v1/completions",
            json={"model": "emu", "prompt": "x", "max_tokens": max_tokens},
            headers={"Authorization": f"Bearer {stack.keys['alpha']}"},
            timeout=30.0,
        )
        reservations = stack.reservations()
    worst_ms = max_tokens * (REPLICA.iter_base_ms + REPLICA.iter_slope_ms)  # and a token's prefill
    if worst_ms <= 500.0:
        assert reply.status_code == 200 and len(reservations) == 1, reply.text
    else:
        assert reply.status_code == 429 and reply.json()["error"]["code"] == "insufficient_quota", reply.text
        assert reservations == []
