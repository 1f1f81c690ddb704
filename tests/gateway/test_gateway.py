"""End to end over real HTTP: the openai client -> gateway -> emulated replica, settled in a real ledger."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import streamed_chat
from tests.gateway import conftest


def client(stack, tenant: str = "alpha") -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.keys[tenant], max_retries=0)


def post(  # type: ignore[no-untyped-def]
    stack, path: str, body: dict[str, Any] | bytes, timeout: float = 30, headers: dict[str, str] | None = None
) -> httpx.Response:
    """``body`` POSTed to the gateway's ``path`` with alpha's key and ``headers``; bytes go as they are, as JSON."""
    headers = {"Authorization": f"Bearer {stack.keys['alpha']}", **(headers or {})}
    if isinstance(body, bytes):
        headers["Content-Type"] = "application/json"
        return httpx.post(f"{stack.url}{path}", content=body, timeout=timeout, headers=headers)
    return httpx.post(f"{stack.url}{path}", json=body, timeout=timeout, headers=headers)


def test_chat_completion_is_served_and_settled(stack):
    reply = client(stack).chat.completions.create(
        model="emu", messages=[{"role": "user", "content": "a b c"}], max_tokens=6, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].message.content == " t1 t2 t3 t4 t5 t6"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (6, 6)
    [r] = stack.reservations()
    assert r.tenant == "alpha" and r.status == "settled"
    assert r.billed.input_tokens == 6 and r.billed.output_tokens == 6 and r.billed.gpu_ms > 0


def test_streaming_with_usage_and_request_id(stack):
    raw = client(stack, "beta").chat.completions.with_raw_response.create(
        **streamed_chat("emu", "hi", 4, extra_headers={"X-Request-Id": "my-req-1"})
    )
    assert raw.headers["x-request-id"] == "my-req-1"
    chunks = list(raw.parse())
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " t1 t2 t3 t4"
    assert chunks[-1].usage.completion_tokens == 4
    [r] = stack.reservations()
    assert (r.tenant, r.request_id, r.status, r.billed.output_tokens) == ("beta", "my-req-1", "settled", 4)


def test_a_retry_with_the_same_request_id_is_not_charged_twice(stack):
    make = lambda: client(stack).completions.create(
        model="emu",
        prompt="x y",
        max_tokens=3,
        extra_body={"ignore_eos": True},
        extra_headers={"Idempotency-Key": "same-1"},
    )
    make()
    with pytest.raises(openai.ConflictError) as excinfo:
        make()
    assert excinfo.value.body["code"] == "request_already_completed"
    assert len(stack.reservations()) == 1


@pytest.mark.parametrize(
    "headers, status", [({}, 401), ({"Authorization": "Bearer nope"}, 401), ({"Authorization": "Basic abc"}, 401)]
)
def test_missing_or_bad_credentials(stack, headers, status):
    reply = httpx.post(
        f"{stack.url}/v1/chat/completions",
        headers=headers,
        timeout=10,
        json={"model": "emu", "messages": [{"role": "user", "content": "x"}]},
    )
    assert reply.status_code == status and reply.json()["error"]["type"] == "authentication_error"


def test_a_forged_tenant_in_body_or_header_is_ignored(stack):
    key = stack.keys["gamma"]
    forged = {"X-Tenant": "alpha", "OpenAI-Organization": "alpha"}
    body = {"model": "emu", "prompt": "x", "max_tokens": 2, "user": "alpha", "ignore_eos": True}
    reply = conftest.post(stack.url, key, body, forged, timeout=10)
    assert reply.status_code == 200
    assert [r.tenant for r in stack.reservations()] == ["gamma"]


MALFORMED_CHAT = [  # (body, status, param) POSTed to /v1/chat/completions
    (b"{not json", 400, None),
    (b'{"model": "emu", "messages": "hi"}', 400, "messages"),
    (b'{"model": "emu", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', 400, "max_tokens"),
    (b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
    (b'{"model": "emu", "messages": [{"role": "user", "content": "' + b"w " * 3000 + b'"}]}', 413, "messages"),
    (b'{"model": "emu", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}', 400, "max_tokens"),
    (b'{"model": "emu", "messages": [{"role": "user", "content": "' + b"w" * 70000 + b'"}]}', 413, None),
]
MISTYPED_COMPLETIONS = [  # (body, param) POSTed to /v1/completions: 400
    (b'{"model": "emu", "prompt": "x", "temperature": NaN}', None),
    (b'{"model": "emu", "prompt": "x", "temperature": 1e400}', "temperature"),
    (b'{"model": "emu", "prompt": "\\ud800"}', "prompt"),
    (b'{"model": "emu", "prompt": "x", "x": ' + b"[" * 30_000 + b"]" * 30_000 + b"}", None),
    (b'{"model": "emu", "prompt": "x", "max_tokens": "5"}', "max_tokens"),
    (b'{"model": "emu", "prompt": "x", "stream": "yes"}', "stream"),
    (b'{"model": "", "prompt": "x"}', "model"),
    # Found by a helper: 950 levels passed the parser, then the upstream call's re-encoding recursed (500).
    (b'{"model": "emu", "prompt": "x", "stream": true, "junk": ' + b"[" * 950 + b"]" * 950 + b"}", "junk" + ".0" * 64),
    (b'{"model": "nope", "model": "emu", "prompt": "x"}', "model"),  # a key twice: which one was meant?
    # Found by a helper: accepted silently before.
    (b'{"model": "emu", "prompt": ["a b", "c d"]}', "prompt"),  # a batch would be one choice each
    (b'{"model": "emu", "prompt": "x", "max_tokens": 4, "max_completion_tokens": 8}', "max_tokens"),
    # OpenAI's sampling fields: the type and range vLLM would hold them to, named in the error.
    (b'{"model": "emu", "prompt": "x", "temperature": "hot"}', "temperature"),
    (b'{"model": "emu", "prompt": "x", "temperature": 2.5}', "temperature"),
    (b'{"model": "emu", "prompt": "x", "top_p": -0.1}', "top_p"),
    (b'{"model": "emu", "prompt": "x", "presence_penalty": "1"}', "presence_penalty"),
    (b'{"model": "emu", "prompt": "x", "frequency_penalty": 3}', "frequency_penalty"),
    (b'{"model": "emu", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}', "stop"),
    (b'{"model": "emu", "prompt": "x", "stop": 7}', "stop"),
    (b'{"model": "emu", "prompt": "x", "logit_bias": {"50256": 101}}', "logit_bias.50256"),
    (b'{"model": "emu", "prompt": "x", "logprobs": 9}', "logprobs"),
    (b'{"model": "emu", "prompt": "x", "user": 12}', "user"),
]


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        *(("/v1/chat/completions", body, status, param) for body, status, param in MALFORMED_CHAT),
        *(("/v1/completions", body, 400, param) for body, param in MISTYPED_COMPLETIONS),
    ],
)
def test_malformed_unsendable_or_mistyped_bodies_are_4xx_and_reserve_nothing(stack, path, body, status, param):
    reply = post(stack, path, body)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param
    assert stack.reservations() == []


def test_client_disconnect_bills_what_was_generated_and_frees_the_slot(stack):
    async def run() -> None:
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
            body = {"model": "emu", "prompt": "x", "max_tokens": 1500, "ignore_eos": True, "stream": True}
            async with http.stream(
                "POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {stack.keys['alpha']}"}
            ) as reply:
                seen = 0
                async for line in reply.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= 20:
                        break
            await asyncio.sleep(0.3)

    asyncio.run(run())
    [r] = stack.reservations()
    assert r.status == "cancelled" and 20 <= r.billed.output_tokens < 100 and r.billed.input_tokens == 1
    # The slot is free again: four more requests (max_batch 4) run at once.
    replies = [client(stack).completions.create(model="emu", prompt="y", max_tokens=2) for _ in range(4)]
    assert all(r.usage.completion_tokens >= 1 for r in replies)


def test_concurrent_duplicates_of_one_request_id_run_once(stack):
    body = {"model": "emu", "prompt": "x", "max_tokens": 30, "ignore_eos": True}
    replies = conftest.post_at_once([(stack.url, stack.keys["alpha"], body, {"Idempotency-Key": "dup-1"})] * 5, 30)
    assert sorted(r.status_code for r in replies) == [200, 409, 409, 409, 409]
    [r] = stack.reservations()
    assert (r.status, r.billed.output_tokens) == ("settled", 30)


def test_well_formed_sampling_fields_are_served(stack):
    body = {
        "model": "emu",
        "prompt": "x",
        "max_tokens": 3,
        "temperature": 0,
        "top_p": 0.9,
        "presence_penalty": -2,
        "frequency_penalty": 1.5,
        "stop": ["\n", "END"],
        "logit_bias": {"50256": -100},
        "logprobs": 2,
        "user": "u-1",
        "seed": 7,
    }
    reply = post(stack, "/v1/completions", body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 3


def test_unknown_route_and_double_credentials(stack):
    reply = httpx.get(f"{stack.url}/v1/images/generations", timeout=10)
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "not_found"
    reply = httpx.post(
        f"{stack.url}/v1/completions",
        json={"model": "emu", "prompt": "x"},
        timeout=10,
        headers=[("Authorization", f"Bearer {stack.keys['alpha']}"), ("Authorization", f"Bearer {stack.keys['beta']}")],
    )
    assert reply.status_code == 400 and stack.reservations() == []


def test_text_without_spaces_is_not_admitted_as_one_token(stack):
    """Found by a helper: a 900 KB prompt with no whitespace counted as 1 token (the emulator's tokenizer)
    and passed the context check, reserving almost nothing."""
    from fairgate.api import estimate_tokens

    assert estimate_tokens("one two three") == 3 and estimate_tokens("x" * 800) == 100
    assert estimate_tokens("ü" * 40) == 10  # 80 bytes of UTF-8
    reply = post(stack, "/v1/completions", {"model": "emu", "prompt": "x" * 20_000})
    assert reply.status_code == 413, reply.text
    assert (
        reply.json()["error"]["code"] == "context_length_exceeded" and "2500 tokens" in reply.json()["error"]["message"]
    )
    assert stack.reservations() == []


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"model": "emu", "messages": [{"role": "bogus", "content": "x"}]}, "messages.0.role", "'user'"),
        (
            {"model": "emu", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
            "top_logprobs",
            "needs logprobs",
        ),
        (
            {"model": "emu", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5},
            "stop",
            "at most 4 stop sequences, got 5",
        ),
    ],
)
def test_chat_bodies_a_replica_would_refuse_are_400_naming_the_field(stack, body, param, words):
    reply = post(stack, "/v1/chat/completions", body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert stack.reservations() == []


@pytest.mark.parametrize(
    "headers, param",
    [
        ([("X-Request-Id", "a"), ("X-Request-Id", "b")], "x-request-id"),
        ([("X-Request-Id", "a"), ("Idempotency-Key", "b")], "x-request-id"),
        ([("X-Request-Id", "")], "x-request-id"),
        ([("Idempotency-Key", "caf\u00e9")], "idempotency-key"),
        ([("X-Fairgate-Run-Id", "r1"), ("X-Fairgate-Run-Id", "r2")], "x-fairgate-run-id"),
        (
            [("X-Fairgate-Run-Id", "r1"), ("X-Fairgate-Tool-Round", "0"), ("X-Fairgate-Tool-Round", "1")],
            "x-fairgate-tool-round",
        ),
    ],
)
def test_ambiguous_or_garbled_id_headers_are_400(stack, headers, param):
    """Found by a helper: the first of two X-Request-Id (or tool-round) headers won, an empty id was replaced
    by a fresh one, and bytes beyond ASCII were stored as Latin-1."""
    encoded = [(name.encode(), value.encode("latin-1")) for name, value in headers]
    reply = httpx.post(
        f"{stack.url}/v1/completions",
        json={"model": "emu", "prompt": "x", "max_tokens": 2},
        timeout=30,
        headers=[(b"Authorization", f"Bearer {stack.keys['alpha']}".encode()), *encoded],
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    assert stack.reservations() == []
    # The same id in both headers is one id.
    same = post(
        stack,
        "/v1/completions",
        {"model": "emu", "prompt": "x", "max_tokens": 2},
        headers={"X-Request-Id": "k-1", "Idempotency-Key": "k-1"},
    )
    assert same.status_code in (200, 409) and same.headers["x-request-id"] == "k-1"


@pytest.mark.parametrize("where", ["tool description", "tool call arguments", "message name", "response schema"])
def test_prompt_text_outside_the_messages_content_counts_at_admission(stack, where):
    """Found by a helper: 900 KB in a tool's description (or a tool call, a name, a response schema) was
    admitted as 4 prompt tokens; the model reads all of it."""
    big = "x" * 40_000  # 5,000 tokens at least: over the test replica's 2,048 context
    messages: list[dict] = [{"role": "user", "content": "hi"}]
    body: dict = {"model": "emu", "max_tokens": 4, "messages": messages}
    if where == "tool description":
        body["tools"] = [{"type": "function", "function": {"name": "f", "description": big}}]
    elif where == "tool call arguments":
        messages += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": big}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ]
    elif where == "message name":
        messages[0]["name"] = big
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"description": big}}}
    reply = post(stack, "/v1/chat/completions", body)
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "context_length_exceeded", reply.text
    small = dict(
        body,
        messages=[{"role": "user", "content": "hi"}],
        tools=[{"type": "function", "function": {"name": "f", "description": "adds two numbers"}}],
    )
    small.pop("response_format", None)
    ok = post(stack, "/v1/chat/completions", small)
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("prompt, tokens", [([11, 12, 13, 14], 4), ([[11, 12]], 2), (["one two three"], 3)])
def test_completions_take_a_prompt_as_token_ids(stack, prompt, tokens):
    """As OpenAI's and vLLM's completions APIs do (a helper found them refused)."""
    reply = post(stack, "/v1/completions", {"model": "emu", "prompt": prompt, "max_tokens": 2, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == tokens
    for bad in ([], [[11], [12]], [-1]):
        refused = post(stack, "/v1/completions", {"model": "emu", "prompt": bad})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt", refused.text
