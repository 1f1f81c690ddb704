"""The gateway in front of a real continuous-batching engine nobody here wrote: llama.cpp's ``llama-server``
(8 slots, one CPU thread, a tiny random-weight llama; tests/engine/conftest.py).

- ``fairgate calibrate`` fits the engine's cost model: its predicted step time at a batch of one and its
  prefill cost per token are within 30 % / 40 % of the engine's own timings (``/completion``'s ``timings``).
- Streaming through the gateway with the ``openai`` client: the usage the client gets is what the ledger
  billed, token for token.
- A client that hangs up stops its sequence in the engine (``/slots``: no slot processing) within a second,
  and the ledger bills no less than the client received.
- Four tenants with different output lengths, all backlogged: under ``gpu_fair`` their GPU time is equal by
  the ledger and by an engine-side measure computed here from the token arrivals (each running sequence's
  share ``1/B`` of the time it runs), max/min <= 1.10, and the billed GPU time is within 10 % of the
  engine's busy time; under ``fcfs`` the long-output tenants take several times the others' share (seed 002).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import pytest

from fairgate.harness.config import TenantSpec
from fairgate.harness.loadgen import TenantLoad
from fairgate.harness.records import RequestRecord
from fairgate.harness.run import run_on_stack
from fairgate.harness.stack import StackSpec, replicas, start_stack
from fairgate.ledger.config import LimitsConfig
from tests.engine.conftest import MODEL, cost_model

pytestmark = pytest.mark.serial  # timing-sensitive: runs alone after the parallel part of the suite

# Output tokens per request: seed 002's mix (23.7 / 53 / 197 / 353.8) halved, fixed per tenant (ignore_eos).
MIX = {"classify": 12, "chat": 27, "summarise": 99, "agent": 177}
FAIR_SECONDS = 30.0


def _spec(calibrated: dict[str, Any], engine_url: str, tenants: tuple[str, ...], policy: str) -> StackSpec:
    limits = LimitsConfig(max_queued=64, max_concurrent=64)
    return StackSpec(
        tuple(TenantSpec(t) for t in tenants),
        policy,
        replicas(1, MODEL),
        cost_model(calibrated),
        engine_urls=(f"{engine_url}",),
        upstream_kind="llamacpp",
        defaults=limits,
    )


def _engine_timings(engine_url: str, words: int, tokens: int) -> dict[str, float]:
    """llama.cpp's own timings of one request alone (its native ``/completion``, no prompt cache)."""
    prompt = " ".join(f"w{i % 97}" for i in range(words))
    body = {"prompt": prompt, "n_predict": tokens, "ignore_eos": True, "cache_prompt": False, "temperature": 0}
    answer = httpx.post(f"{engine_url}/completion", json=body, timeout=120.0)
    answer.raise_for_status()
    timings = answer.json()["timings"]
    return {k: float(v) for k, v in timings.items()}


def test_calibrate_fits_the_engine_within_the_stated_error(calibrated, engine_url):
    assert calibrated["max_batch"] == 8  # from the engine's /props
    assert calibrated["kind"] == "llamacpp" and calibrated["url"] == f"{engine_url}/v1"
    for name in ("iter_base_ms", "iter_slope_ms", "prefill_ms_per_token", "max_batch"):
        assert name in calibrated["stdout"]
    alone = _engine_timings(engine_url, 32, 64)
    predicted_step_ms = calibrated["iter_base_ms"] + calibrated["iter_slope_ms"]
    assert predicted_step_ms == pytest.approx(alone["predicted_per_token_ms"], rel=0.30)
    long_prompt = _engine_timings(engine_url, 600, 1)
    assert calibrated["prefill_ms_per_token"] == pytest.approx(long_prompt["prompt_per_token_ms"], rel=0.40)


def test_a_stream_through_the_gateway_is_billed_what_the_client_received(calibrated, engine_url):
    with start_stack(_spec(calibrated, engine_url, ("alpha",), "gpu_fair")) as stack:
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.keys["alpha"], max_retries=0)
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "tell me something"}],
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            extra_headers={"X-Request-Id": "stream-1"},
        )
        chunks, usage = 0, None
        for chunk in stream:
            chunks += bool(chunk.choices and chunk.choices[0].delta.content)
            usage = chunk.usage or usage
        assert usage is not None and usage.completion_tokens == 24 and usage.prompt_tokens > 4
        assert 20 <= chunks <= 24  # a token with empty text (a control token) sends no chunk
        [r] = [r for r in asyncio.run(stack.reservations()) if r.request_id == "stream-1"]
        assert r.status == "settled"
        assert (r.billed.input_tokens, r.billed.output_tokens) == (usage.prompt_tokens, 24)
        assert r.billed.gpu_ms > 0


def _processing(engine_url: str) -> int:
    return sum(bool(s.get("is_processing")) for s in httpx.get(f"{engine_url}/slots", timeout=5.0).json())


def test_a_client_that_hangs_up_stops_its_sequence_in_the_engine(calibrated, engine_url):
    with start_stack(_spec(calibrated, engine_url, ("alpha",), "gpu_fair")) as stack:
        headers = {"Authorization": f"Bearer {stack.keys['alpha']}", "X-Request-Id": "cut-1"}
        body = {"model": MODEL, "prompt": "w " * 16, "max_tokens": 4000, "stream": True, "ignore_eos": True}
        received = 0
        with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, headers=headers, timeout=60) as answer:
            for line in answer.iter_lines():
                received += line.startswith("data:") and '"text"' in line
                if received >= 10:
                    break
        assert _processing(engine_url) == 1  # still generating the moment the client leaves
        left_s = time.monotonic()
        while _processing(engine_url) and time.monotonic() - left_s < 5.0:
            time.sleep(0.02)
        stopped_s = time.monotonic() - left_s
        assert stopped_s <= 1.0, f"the engine's slot ran {stopped_s:.2f} s after the client left"
        time.sleep(0.5)  # the gateway's final settlement
        [r] = [r for r in asyncio.run(stack.reservations()) if r.request_id == "cut-1"]
        assert r.status == "cancelled"
        assert received <= r.billed.output_tokens <= 4000


def slot_time_ms(records: list[RequestRecord], step_ms: float) -> dict[str, float]:
    """Each tenant's GPU time by the charge rule, measured on the client side: a request runs from one step
    before its first token to its last token; at every instant each of the ``B`` requests running gets
    ``1/B`` of the time. An independent computation of what the gateway's meter does."""
    events: list[tuple[float, int, str]] = []
    for r in records:
        if r.first_s is not None and r.last_s is not None:
            events += [(r.first_s - step_ms / 1000.0, 1, r.tenant), (r.last_s, -1, r.tenant)]
    events.sort()
    running: dict[str, int] = {}
    out: dict[str, float] = {}
    last = events[0][0] if events else 0.0
    for at, delta, tenant in events:
        batch = sum(running.values())
        if batch:
            for t, n in running.items():
                out[t] = out.get(t, 0.0) + (at - last) * 1000.0 * n / batch
        running[tenant] = running.get(tenant, 0) + delta
        last = at
    return out


def _fairness(
    calibrated: dict[str, Any], engine_url: str, policy: str
) -> tuple[dict[str, float], dict[str, float], float]:
    spec = _spec(calibrated, engine_url, tuple(MIX), policy)
    loads = [TenantLoad(t, clients=4, output_tokens=(n, n), prompt_tokens=64) for t, n in MIX.items()]
    run = run_on_stack(spec, loads, FAIR_SECONDS, seed=1)
    billed = dict.fromkeys(MIX, 0.0)
    for r in run.reservations:
        billed[r.tenant] += r.billed.gpu_ms
    step_ms = calibrated["iter_base_ms"] + calibrated["iter_slope_ms"] * 8
    engine = slot_time_ms(run.history.records, step_ms)
    return billed, engine, sum(engine.values())


def _ratio(values: dict[str, float]) -> float:
    return max(values.values()) / min(values.values())


def test_gpu_fair_gives_equal_gpu_time_on_the_engine_and_fcfs_does_not(calibrated, engine_url):
    billed, engine, busy_ms = _fairness(calibrated, engine_url, "gpu_fair")
    assert _ratio(billed) <= 1.10, billed
    assert _ratio(engine) <= 1.10, engine
    assert sum(billed.values()) == pytest.approx(busy_ms, rel=0.10)
    billed_fcfs, engine_fcfs, _ = _fairness(calibrated, engine_url, "fcfs")
    assert _ratio(billed_fcfs) >= 2.0, billed_fcfs
    assert _ratio(engine_fcfs) >= 2.0, engine_fcfs
    assert engine_fcfs["agent"] > engine_fcfs["classify"]
