"""The OpenAI wire contract shared by the gateway and the emulated replica (``fairgate.api``)."""

import pytest
from pydantic import ValidationError

import fairgate.api
from fairgate.api import (
    ChatRequest,
    CompletionRequest,
    count_prompt_tokens,
    error_body,
    estimate_prompt_tokens,
    estimate_tokens,
)

MODULES = ("errors", "schema", "tokens")  # the package's own modules, public by import


def test_everything_public_is_exported_and_nothing_else():
    """What ``fairgate.api`` exports is a contract (as httpx pins ``httpx.__all__``): every public name of the
    module is in ``__all__``, sorted, and every name there exists."""
    public = sorted(name for name in vars(fairgate.api) if not name.startswith("_") and name not in MODULES)
    assert fairgate.api.__all__ == public
    assert {"ChatRequest", "CompletionRequest", "estimate_prompt_tokens", "error_body"} <= set(public)


def test_the_replica_counts_words_and_the_gateway_estimates_at_least_one_token_per_8_bytes():
    chat = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "one two three"}]})
    assert count_prompt_tokens(chat) == 3 + 3  # 3 words + the message's template overhead
    assert estimate_prompt_tokens(chat) == 6
    word = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x" * 800}]})
    assert count_prompt_tokens(word) == 1 + 3 and estimate_prompt_tokens(word) == 100 + 3
    assert estimate_tokens("ü" * 40) == 10  # 80 bytes of UTF-8


def test_tool_definitions_count_as_prompt_for_the_estimate_only():
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "description": "d " * 400}}],
    }
    chat = ChatRequest.model_validate(body)
    assert count_prompt_tokens(chat) == 4
    assert estimate_prompt_tokens(chat) >= 4 + 400


def test_completion_prompts_as_text_or_token_ids():
    assert count_prompt_tokens(CompletionRequest.model_validate({"model": "m", "prompt": "a b"})) == 2
    assert count_prompt_tokens(CompletionRequest.model_validate({"model": "m", "prompt": [5, 6, 7]})) == 3
    assert estimate_prompt_tokens(CompletionRequest.model_validate({"model": "m", "prompt": [[5, 6]]})) == 2
    with pytest.raises(ValidationError, match="one prompt a request"):
        CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"]})


def test_the_error_body_is_openai_shaped():
    assert error_body("no", "invalid_request_error", "model", "model_not_found") == {
        "error": {"message": "no", "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    }
