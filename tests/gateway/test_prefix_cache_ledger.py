"""A prefix-cache hit through the whole gateway, per request id: what each client received against what the
ledger billed and the request log recorded. An emulated replica with prefix caching; tenant beta streams a
long answer while alpha sends one long prompt twice (the second read from the cache)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai

from fairgate.emulator.api import create_app
from fairgate.gateway.eventlog import read_records
from tests.gateway import conftest

PROMPT = " ".join(f"p{i}" for i in range(1200))


def _stream(stack: conftest.Stack, tenant: str, request_id: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """Stream a completion; the text pieces received and the usage the client was sent."""
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.keys[tenant], max_retries=0, timeout=60)
    pieces, usage = 0, None
    for chunk in client.completions.create(
        model="emu",
        prompt=prompt,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
        extra_headers={"x-request-id": request_id},
    ):
        pieces += bool(chunk.choices and chunk.choices[0].text)
        usage = chunk.usage or usage
    assert usage is not None
    return {"pieces": pieces, "usage": usage}


def test_a_cached_prompt_is_billed_in_the_ledger_as_the_client_and_the_log_were_told(tmp_path: Path) -> None:
    emulator = create_app(replace(conftest.REPLICA, prefix_caching=True).settings("emu"))
    with conftest.serve_stack(tmp_path, emulator) as stack:
        received: dict[str, dict[str, Any]] = {}
        beside = threading.Thread(target=lambda: received.update(b=_stream(stack, "beta", "b", "go", 400)))
        beside.start()
        time.sleep(0.2)  # beta decoding: alpha's prefills run beside it
        received["cached-1"] = _stream(stack, "alpha", "cached-1", PROMPT, 20)
        received["cached-2"] = _stream(stack, "alpha", "cached-2", PROMPT, 20)
        beside.join(timeout=60)
        reservations = {r.request_id: r for r in stack.reservations()}
        log_path = stack.config.event_log_path
    assert log_path is not None
    finished = {rec["request_id"]: rec for _, _, rec in read_records(log_path) if rec.get("event") == "finished"}
    for request_id, got in received.items():
        r = reservations[request_id]
        assert r.status == "settled", r
        assert r.billed.output_tokens == got["pieces"] == got["usage"].completion_tokens
        assert r.billed.input_tokens == got["usage"].prompt_tokens
        assert finished[request_id]["gpu_ms"] == round(r.billed.gpu_ms, 3)
    first, second = received["cached-1"]["usage"], received["cached-2"]["usage"]
    assert first.prompt_tokens_details is None and "cached_tokens" not in finished["cached-1"]
    cached = second.prompt_tokens_details.cached_tokens
    assert PROMPT_BLOCKS_CACHED <= cached < second.prompt_tokens
    assert finished["cached-2"]["cached_tokens"] == cached and finished["cached-2"]["cache_credit_gpu_ms"] > 0


# The emulator caches whole 16-token blocks and computes a prompt's last token at least (vLLM's rule).
PROMPT_BLOCKS_CACHED = (1200 - 1) // 16 * 16
