"""Misspelt keys inside a request's objects, over real HTTP with the real ``openai`` client -> the gateway -> an
emulated replica: refused 400 in OpenAI's error format, ``param`` the path at fault, nothing reserved; what
OpenAI or the engines (vLLM, SGLang, llama-server) take passes.

Found by a new user: ``stream_options: {"include_usagee": true}`` was answered 200 and the stream ended without
its usage chunk; ``tool_choice: "sometimes"``, ``response_format: {"type": "json_objct"}``, a tool's
``functon``, a ``txt`` content part and a message's unknown keys were accepted too."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

HELLO = [{"role": "user", "content": "hello"}]
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture
def client(stack) -> Iterator[openai.OpenAI]:  # type: ignore[no-untyped-def]
    """Tenant alpha's client, closed after the test (its sockets are not left to the garbage collector)."""
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.keys["alpha"], max_retries=0, timeout=30) as client:
        yield client


REFUSED_CHAT: list[tuple[dict[str, Any], str]] = [  # (chat fields, param): 400
    ({"stream": True, "stream_options": {"include_usagee": True}}, "stream_options.include_usagee"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
    ({"tool_choice": "sometimes", "tools": [TOOL]}, "tool_choice"),
    ({"tool_choice": {"type": "function", "functon": {"name": "lookup"}}, "tools": [TOOL]}, "tool_choice.functon"),
    ({"tool_choice": {"type": "function", "function": {}}, "tools": [TOOL]}, "tool_choice.function.name"),
    ({"tool_choice": {"type": "fn", "function": {"name": "lookup"}}, "tools": [TOOL]}, "tool_choice.type"),
    ({"response_format": {"type": "json_objct"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schma": {"name": "x"}}}, "response_format.json_schma"),
    ({"tools": [{"type": "function", "functon": {"name": "lookup"}}]}, "tools.0.functon"),
    ({"tools": [TOOL, {"type": "function", "function": {"name": "f", "paramters": {}}}]}, "tools.1.function.paramters"),
    ({"tools": [{"type": "functions", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"messages": [{"role": "user", "content": [{"type": "txt", "text": "hi"}]}]}, "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "txt": "hi"}]}]}, "messages.0.content.0.text"),
    (
        {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "imag_url"}]}]},
        "messages.1.content.0.type",
    ),
    ({"messages": [{"role": "user", "contnet": "hi"}]}, "messages.0.contnet"),
    ({"messages": [{"role": "assistant", "content": "a", "tool_call": []}, *HELLO]}, "messages.0.tool_call"),
]


@pytest.mark.parametrize(("fields", "param"), REFUSED_CHAT)
def test_a_misspelt_nested_key_is_a_400_naming_its_path(
    stack, client: openai.OpenAI, fields: dict[str, Any], param: str
) -> None:  # type: ignore[no-untyped-def]
    body = {"model": "emu", "messages": HELLO, "max_tokens": 3, **fields}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**body)
    error = refused.value.body
    assert refused.value.status_code == 400 and error["param"] == param, error  # type: ignore[index]
    assert error["type"] == "invalid_request_error" and error["message"].startswith(f"{param}: "), error  # type: ignore[index]
    assert stack.reservations() == []


def test_a_misspelt_stream_option_is_refused_on_completions_too(stack, client: openai.OpenAI) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(
            model="emu",
            prompt="x",
            max_tokens=3,
            stream=True,
            stream_options={"include_usagee": True},  # type: ignore[typeddict-unknown-key]
        )
    assert refused.value.body["param"] == "stream_options.include_usagee"  # type: ignore[index]
    assert stack.reservations() == []


ACCEPTED_CHAT: list[dict[str, Any]] = [  # OpenAI's shapes, and the engines' own
    {"tools": [TOOL], "tool_choice": "auto"},
    {"tools": [TOOL], "tool_choice": "required"},
    {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "lookup"}}},
    {"tools": [{"function": {"name": "lookup"}}], "tool_choice": {"function": {"name": "lookup"}}},  # vLLM's defaults
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
    {"response_format": {"type": "structural_tag", "format": {"type": "any_text"}}},  # vLLM's
    {"response_format": {"type": "json_object", "schema": {"type": "object"}}},  # llama-server's
    {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "video_url", "video_url": {"url": "u"}}],
            },
            {"role": "assistant", "content": "b", "reasoning_content": "r", "thinking": "kept for the template"},
            {"role": "user", "content": [{"type": "image_embeds", "image_embeds": "e"}, {"type": "point_cloud"}]},
        ]
    },
]


@pytest.mark.parametrize("fields", ACCEPTED_CHAT)
def test_what_openai_or_an_engine_takes_passes(stack, client: openai.OpenAI, fields: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    body = {"model": "emu", "messages": HELLO, "max_tokens": 2, **fields}
    reply = client.chat.completions.create(**body)
    assert reply.usage is not None and reply.usage.completion_tokens >= 1


def test_include_usage_spelt_right_ends_the_stream_with_usage_with_or_without_obfuscation(
    stack, client: openai.OpenAI
) -> None:  # type: ignore[no-untyped-def]
    for options in ({"include_usage": True}, {"include_usage": True, "include_obfuscation": False}):
        chunks = list(
            client.chat.completions.create(
                model="emu",
                messages=HELLO,
                max_tokens=2,
                stream=True,
                stream_options=options,  # type: ignore[arg-type]
            )
        )
        assert chunks[-1].usage is not None and chunks[-1].choices == [], options
