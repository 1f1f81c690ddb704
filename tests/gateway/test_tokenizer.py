"""The engine's own prompt count sizes a request (``fairgate.gateway.tokenizer``), and llama.cpp's running
token count counts a stream (``Kind.counts_from_timings``), over real HTTP: the ``openai`` client or httpx ->
the gateway -> a fake vLLM / llama.cpp engine (a Starlette app) serving its tokenizer endpoints
(``/tokenize``, ``/apply-template``) beside the chat stream, recording what each receives; and the emulated
replica's own ``/tokenize``."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fairgate.api import ChatRequest, estimate_prompt_tokens, prompt_tokens_floor
from tests.gateway import conftest

HELLO = [{"role": "user", "content": "hello"}]
TEMPLATED = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
CONTEXT = 2048  # the test config's max_model_len


@dataclass
class TokenizingEngine:
    """A vLLM or llama.cpp server: ``/tokenize`` answers ``count`` tokens (or ``answer`` as given, after
    ``stall_s``); llama.cpp's ``/apply-template`` answers ``TEMPLATED``; the chat stream sends ``chunks``
    (default three words with usage). ``calls``: (path, body) of every request, in order."""

    kind: str = "vllm"
    count: int = 49
    answer: tuple[int, Any] | None = None
    stall_s: float = 0.0
    chunks: list[dict[str, Any]] | None = None
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def app(self) -> Starlette:
        async def tokenize(request: Request) -> Response:
            self.calls.append(("/tokenize", await request.json()))
            await asyncio.sleep(self.stall_s)
            if self.answer is not None:
                return JSONResponse(self.answer[1], self.answer[0])
            if self.kind == "vllm":
                return JSONResponse({"count": self.count, "max_model_len": CONTEXT, "tokens": [7] * self.count})
            return JSONResponse({"tokens": [7] * self.count})

        async def template(request: Request) -> Response:
            self.calls.append(("/apply-template", await request.json()))
            return JSONResponse({"prompt": TEMPLATED})

        async def chat(request: Request) -> Response:
            self.calls.append(("/v1/chat/completions", await request.json()))
            return StreamingResponse(self._events(), media_type="text/event-stream")

        routes = [Route("/tokenize", tokenize, methods=["POST"]), Route("/v1/chat/completions", chat, methods=["POST"])]
        if self.kind == "llamacpp":
            routes.append(Route("/apply-template", template, methods=["POST"]))
        return Starlette(routes=routes)

    async def _events(self) -> AsyncIterator[str]:
        words = [{"choices": [{"index": 0, "delta": {"content": w}}]} for w in ("one", " two", " three")]
        usage = {"choices": [], "usage": {"prompt_tokens": self.count, "completion_tokens": 3}}
        for chunk in self.chunks if self.chunks is not None else [*words, usage]:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    def paths(self) -> list[str]:
        return [path for path, _ in self.calls]


@contextmanager
def gateway(tmp: Path, engine: TokenizingEngine, **upstream: Any) -> Iterator[tuple[conftest.Stack, openai.OpenAI]]:
    """The gateway in front of ``engine`` (its kind; ``upstream``: more keys of its ``[[upstream]]``) and an
    OpenAI client of tenant alpha that does not retry."""
    with conftest.serve_stack(
        tmp, engine.app(), upstream_table={"kind": engine.kind, "tokenize": True, **upstream}
    ) as stack:
        yield stack, openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.keys["alpha"], max_retries=0, timeout=30)


def test_vllm_counts_the_chat_with_its_template_and_the_reservation_takes_its_count(tmp_path: Path) -> None:
    engine = TokenizingEngine("vllm", count=49)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with gateway(tmp_path, engine) as (stack, client):
        reply = client.chat.completions.create(model="emu", messages=HELLO, max_tokens=3, tools=tools)  # type: ignore[arg-type]
        [r] = stack.reservations()
    assert reply.choices[0].message.content == "one two three"
    assert engine.paths() == ["/tokenize", "/v1/chat/completions"]  # counted before it was sent
    asked = engine.calls[0][1]
    assert asked == {"model": "emu", "messages": HELLO, "add_generation_prompt": True, "tools": tools}
    assert estimate_prompt_tokens(ChatRequest(model="emu", messages=HELLO, tools=tools)) != 49
    assert r.input_tokens == 49 and r.billed.input_tokens == 49 and r.status == "settled"


def test_vllm_counts_a_completions_prompt(tmp_path: Path) -> None:
    engine = TokenizingEngine("vllm", count=31, chunks=[])

    async def completions(request: Request) -> Response:
        engine.calls.append(("/v1/completions", await request.json()))
        chunks = [{"choices": [{"index": 0, "text": "x"}]}, {"choices": [], "usage": {"prompt_tokens": 31}}]
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return Response(body, media_type="text/event-stream")

    app = engine.app()
    app.router.routes.append(Route("/v1/completions", completions, methods=["POST"]))
    with conftest.serve_stack(tmp_path, app, upstream_table={"kind": "vllm", "tokenize": True}) as stack:
        headers = {"Authorization": f"Bearer {stack.keys['alpha']}"}
        body = {"model": "emu", "prompt": "say hello", "max_tokens": 1}
        reply = httpx.post(f"{stack.url}/v1/completions", json=body, headers=headers, timeout=30)
        [r] = stack.reservations()
    assert reply.status_code == 200, reply.text
    assert engine.calls[0] == ("/tokenize", {"model": "emu", "prompt": "say hello"})
    assert r.input_tokens == 31


def test_llamacpp_applies_its_template_then_tokenizes_with_bos(tmp_path: Path) -> None:
    engine = TokenizingEngine("llamacpp", count=17)
    with gateway(tmp_path, engine) as (stack, client):
        client.chat.completions.create(model="emu", messages=HELLO, max_tokens=3)
        [r] = stack.reservations()
    assert engine.paths() == ["/apply-template", "/tokenize", "/v1/chat/completions"]
    assert engine.calls[0][1] == {"messages": HELLO}
    assert engine.calls[1][1] == {"content": TEMPLATED, "add_special": True}
    assert r.input_tokens == 17


def test_a_prompt_the_engine_counts_past_the_context_is_refused_before_anything_is_reserved(tmp_path: Path) -> None:
    """``"hello" * 1200`` is estimated 750 tokens (one per 8 bytes) and fits the 2,048-token context; the
    engine counts 4,817: 413 ``context_length_exceeded``, nothing reserved, nothing sent to generate."""
    engine = TokenizingEngine("llamacpp", count=4817)
    long = [{"role": "user", "content": "hello" * 1200}]
    assert estimate_prompt_tokens(ChatRequest(model="emu", messages=long)) < CONTEXT
    with gateway(tmp_path, engine) as (stack, client):
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(model="emu", messages=long, max_tokens=3)  # type: ignore[arg-type]
        assert stack.reservations() == []
    assert refused.value.status_code == 413 and refused.value.code == "context_length_exceeded"
    assert "4817 tokens" in refused.value.message and refused.value.body["param"] == "messages"  # type: ignore[index]
    assert "/v1/chat/completions" not in engine.paths()


def test_an_engine_count_below_the_bytes_floor_is_held_to_it(tmp_path: Path) -> None:
    engine = TokenizingEngine("vllm", count=1)
    text = [{"role": "user", "content": "x" * 4000}]
    with gateway(tmp_path, engine) as (stack, client):
        client.chat.completions.create(model="emu", messages=text, max_tokens=3)  # type: ignore[arg-type]
        [r] = stack.reservations()
    assert r.input_tokens == prompt_tokens_floor(ChatRequest(model="emu", messages=text)) == 500


@pytest.mark.parametrize(
    ("answer", "stall_s", "problem"),
    [
        (None, 2.0, "TimeoutError"),  # past tokenize_timeout_s
        ((500, {"error": "boom"}), 0.0, "answered 500"),
        ((200, {"tokens": "seven"}), 0.0, "answered a count of"),  # vLLM's count missing
        ((200, ["not", "an", "object"]), 0.0, "not a JSON object"),
    ],
)
def test_a_tokenizer_that_fails_leaves_the_estimate_and_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, answer: tuple[int, Any] | None, stall_s: float, problem: str
) -> None:
    caplog.set_level(logging.INFO, "fairgate.gateway")
    engine = TokenizingEngine("vllm", answer=answer, stall_s=stall_s)
    with gateway(tmp_path, engine, tokenize_timeout_s=0.2) as (stack, client):
        started = time.monotonic()
        for _ in range(2):
            reply = client.chat.completions.create(model="emu", messages=HELLO, max_tokens=3)
        took_s = time.monotonic() - started
        reservations = stack.reservations()
    assert reply.choices[0].message.content == "one two three"
    assert [r.input_tokens for r in reservations] == [
        estimate_prompt_tokens(ChatRequest(model="emu", messages=HELLO))
    ] * 2
    assert took_s < 1.5  # each waited for the tokenizer 0.2 s at most
    lines = [json.loads(m) for m in caplog.messages if "tokenizer_unavailable" in m]
    assert len(lines) == 1 and lines[0]["upstream"] == "emu-0" and problem in lines[0]["problem"], lines


def test_an_engine_without_the_endpoint_or_tokenize_off_is_estimated(tmp_path: Path) -> None:
    engine = TokenizingEngine("vllm")
    with gateway(tmp_path, engine, tokenize=False) as (stack, client):
        client.chat.completions.create(model="emu", messages=HELLO, max_tokens=3)
        [r] = stack.reservations()
    assert engine.paths() == ["/v1/chat/completions"]
    assert r.input_tokens == estimate_prompt_tokens(ChatRequest(model="emu", messages=HELLO))
    hosted = TokenizingEngine("openai")
    with gateway(tmp_path / "hosted", hosted) as (stack, client):
        client.chat.completions.create(model="emu", messages=HELLO, max_tokens=3)
    assert hosted.paths() == ["/v1/chat/completions"]


def _llamacpp_chunk(text: str | None, predicted_n: int | None) -> dict[str, Any]:
    chunk: dict[str, Any] = {"choices": [{"index": 0, "delta": {"content": text}}]} if text is not None else {}
    if predicted_n is not None:
        chunk["timings"] = {"prompt_n": 5, "predicted_n": predicted_n, "predicted_ms": 1.0}
    return chunk


def test_llamacpp_tokens_without_text_are_counted_from_its_running_count(tmp_path: Path) -> None:
    """Token 3 decoded to no text and got no chunk (the next one says 4 generated), and the last one the same
    (only the usage-less closing chunk says 6): all 6 are counted and billed, not the 4 relayed."""
    chunks = [_llamacpp_chunk(t, n) for t, n in (("a", 1), ("b", 2), ("c", 4), ("d", 5))]
    chunks += [
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
        {"choices": [], **_llamacpp_chunk(None, 6)},
    ]
    engine = TokenizingEngine("llamacpp", count=5, chunks=chunks)
    with gateway(tmp_path, engine) as (stack, client):
        reply = client.chat.completions.create(model="emu", messages=HELLO, max_tokens=6)
        [r] = stack.reservations()
    assert reply.choices[0].message.content == "abcd"
    assert engine.calls[-1][1]["timings_per_token"] is True
    assert r.status == "settled" and r.billed.output_tokens == 6 and reply.usage is not None
    assert reply.usage.completion_tokens == 6


def test_llamacpp_running_count_past_max_tokens_stops_the_stream(tmp_path: Path) -> None:
    chunks = [_llamacpp_chunk(t, n) for t, n in (("a", 1), ("b", 5))]  # 3 unseen tokens: 5 > max_tokens 4
    engine = TokenizingEngine("llamacpp", count=5, chunks=chunks)
    with gateway(tmp_path, engine) as (stack, client):
        stream = client.chat.completions.create(model="emu", messages=HELLO, max_tokens=4, stream=True)
        texts = []
        with pytest.raises(openai.APIError) as stopped:
            for chunk in stream:
                texts += [c.delta.content for c in chunk.choices if c.delta.content]
        [r] = stack.reservations()
    assert texts == ["a"] and "max_tokens" in str(stopped.value)
    assert r.billed.output_tokens == 1


def test_an_engine_count_no_tokenizer_could_give_is_not_believed(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    """30,000 tokens for a 26-byte chat is more than one a byte plus any chat template: the estimate sizes it,
    and the engine's usage (10) is what is billed - the count it answered at first never reaches the bill."""
    engine = TokenizingEngine("vllm", count=30_000, chunks=[])
    words = [{"choices": [{"index": 0, "delta": {"content": w}}]} for w in ("one", " two", " three")]
    engine.chunks = [*words, {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 3}}]
    chat = [{"role": "user", "content": "hello there general kenobi"}]
    with gateway(tmp_path, engine) as (stack, client):
        reply = client.chat.completions.create(model="emu", messages=chat, max_tokens=3)  # type: ignore[arg-type]
        [r] = stack.reservations()
    assert r.input_tokens == estimate_prompt_tokens(ChatRequest(model="emu", messages=chat)) < 30_000, r
    assert r.billed.input_tokens == 10 and reply.usage is not None and reply.usage.prompt_tokens == 10
    assert any("tokenizer_unavailable" in m and "more than the prompt's bytes" in m for m in caplog.messages)


def test_an_engine_whose_count_sized_the_request_is_billed_its_usage_below_that_count(tmp_path: Path) -> None:
    """The engine counted 200 (within what the prompt can be) and then reported 10 in its usage: the usage is
    believed (it is above the gateway's own estimate's under-report bound), and billed."""
    engine = TokenizingEngine("vllm", count=200, chunks=[])
    words = [{"choices": [{"index": 0, "delta": {"content": w}}]} for w in ("one", " two", " three")]
    engine.chunks = [*words, {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 3}}]
    chat = [{"role": "user", "content": "hello there general kenobi " * 6}]
    with gateway(tmp_path, engine) as (stack, client):
        client.chat.completions.create(model="emu", messages=chat, max_tokens=3)  # type: ignore[arg-type]
        [r] = stack.reservations()
    assert (r.input_tokens, r.billed.input_tokens) == (200, 10), r


def test_a_prompt_over_the_context_by_its_bytes_alone_is_refused_without_asking_the_engine(tmp_path: Path) -> None:
    engine = TokenizingEngine("vllm", count=10)
    long = [{"role": "user", "content": "x" * (8 * CONTEXT + 8)}]
    with gateway(tmp_path, engine, max_model_len=CONTEXT) as (stack, client):
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(model="emu", messages=long, max_tokens=3)  # type: ignore[arg-type]
        assert stack.reservations() == []
    assert refused.value.status_code == 413 and engine.paths() == []


def test_a_tenant_its_request_rate_refuses_is_not_counted_by_the_engine_until_a_request_is_due(tmp_path: Path) -> None:
    """One request a second, a burst of one: the second request is counted (nothing says yet that the ledger
    will refuse it) and refused; the ones after it, until the bucket holds a request again, are refused
    without a tokenize call; once it does, the engine counts again."""
    engine = TokenizingEngine("vllm", count=49)
    limits = conftest.LimitsConfig(requests_per_minute=60, requests_burst=1)
    table = {"kind": "vllm", "tokenize": True}
    with conftest.serve_stack(tmp_path, engine.app(), upstream_table=table, defaults=limits) as stack:
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.keys["alpha"], max_retries=0, timeout=30)
        client.chat.completions.create(model="emu", messages=HELLO, max_tokens=3)  # type: ignore[arg-type]
        refused = []
        for _ in range(4):
            with pytest.raises(openai.RateLimitError) as caught:
                client.chat.completions.create(model="emu", messages=HELLO, max_tokens=3)  # type: ignore[arg-type]
            refused.append(caught.value.response.headers.get("x-fairgate-quota-dimension"))
        assert refused == ["requests_per_minute"] * 4
        assert engine.paths() == ["/tokenize", "/v1/chat/completions", "/tokenize"]
        # A request naming its id may retry one admitted (sized by the count, which its retry must repeat):
        # still counted, and refused.
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(  # type: ignore[call-overload]
                model="emu", messages=HELLO, max_tokens=3, extra_headers={"x-request-id": "mine-1"}
            )
        assert engine.paths()[-1] == "/tokenize" and len(engine.paths()) == 4
        time.sleep(1.1)  # the bucket holds a request again
        client.chat.completions.create(model="emu", messages=HELLO, max_tokens=3)  # type: ignore[arg-type]
        [*_, counted, sent] = engine.paths()
        assert (counted, sent) == ("/tokenize", "/v1/chat/completions")
        assert all(r.input_tokens == 49 for r in stack.reservations())  # every one admitted sized by the count


def test_the_emulated_replica_counts_with_its_tokenizer_and_agrees_with_its_usage(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "fairgate.gateway")
    with conftest.serve_stack(tmp_path, upstream_table={"tokenize": True}) as stack:  # the emulated replica
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.keys["alpha"], max_retries=0, timeout=30)
        reply = client.chat.completions.create(model="emu", messages=HELLO, max_tokens=3)
        [r] = stack.reservations()
    assert not [m for m in caplog.messages if "tokenizer_unavailable" in m]  # it was "NoCount: answered 404"
    assert reply.usage is not None and r.input_tokens == reply.usage.prompt_tokens == 4
