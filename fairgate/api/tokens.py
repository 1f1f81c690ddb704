"""Prompt-token counts: the emulated replica's exact count, and the gateway's estimate for admission.

The emulated replica's tokenizer is one token per whitespace-separated word, plus
``CHAT_MESSAGE_OVERHEAD_TOKENS`` per chat message (the role and template markers). The gateway holds no
tokenizer of an upstream's model; where the engine cannot count a prompt for it (``fairgate.gateway.
tokenizer``), it estimates: the same count, but at least one token per ``BYTES_PER_TOKEN_MAX`` bytes of
UTF-8 text, and counting everything else the upstream receives as prompt (tool definitions, tool calls,
names, a response schema, content parts that are not text - an image's data - and fields the gateway does
not know, which it passes on). The count bounds the reservation and the context check (an engine's own
count no lower than ``prompt_tokens_floor``); the upstream's reported usage settles the exact count (billed
as reported up to the serving engines' context; past ``rules.input_allowance`` of the estimate it is
flagged, so an estimate must not leave anything out).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable

from fairgate.api.schema import ChatMessage, ChatRequest, CompletionRequest, EmbeddingRequest

CHAT_MESSAGE_OVERHEAD_TOKENS = 3
# BPE tokenizers give one token per ~4 bytes of English; none in use gives fewer than one per 8 bytes, so
# text without spaces (a 900 KB word would count as 1 word) is not admitted for almost nothing.
BYTES_PER_TOKEN_MAX = 8
# What a chat template adds per message, at most, and to the whole prompt (the system prompt a template may
# insert, a generation prompt, BOS): a ceiling on an engine's count, far above any template in use.
TEMPLATE_TOKENS_PER_MESSAGE_MAX = 64
TEMPLATE_TOKENS_MAX = 256
# A chat body's prompt besides its messages' content.
PROMPT_FIELDS = ("tools", "functions", "tool_choice", "response_format")


def count_tokens(text: str) -> int:
    """The emulated replica's tokenizer: whitespace-separated words."""
    return len(text.split())


def count_prompt_tokens(body: ChatRequest | CompletionRequest) -> int:
    """The prompt tokens the emulated replica counts for ``body`` (token ids: one each)."""
    if isinstance(body, ChatRequest):
        return sum(count_tokens(m.text()) + CHAT_MESSAGE_OVERHEAD_TOKENS for m in body.messages)
    text = body.prompt_text()
    return count_tokens(text) if text is not None else len(body.prompt_token_ids())


def estimate_tokens(text: str) -> int:
    """The gateway's estimate of ``text``: words, but at least one token per ``BYTES_PER_TOKEN_MAX`` bytes."""
    return max(count_tokens(text), math.ceil(len(text.encode("utf-8")) / BYTES_PER_TOKEN_MAX))


def estimate_prompt_tokens(body: ChatRequest | CompletionRequest) -> int:
    """The gateway's admission estimate of ``body``'s prompt tokens (see module docstring)."""
    return _prompt_count(body, estimate_tokens, CHAT_MESSAGE_OVERHEAD_TOKENS)


def bytes_floor(text: str) -> int:
    """The fewest tokens any tokenizer in use gives ``text``: one per ``BYTES_PER_TOKEN_MAX`` UTF-8 bytes."""
    return math.ceil(len(text.encode("utf-8")) / BYTES_PER_TOKEN_MAX)


def prompt_tokens_floor(body: ChatRequest | CompletionRequest) -> int:
    """The fewest prompt tokens ``body`` can be, whoever counts it: ``bytes_floor`` of everything the
    estimate counts, no chat-template overhead (token ids: one each). An engine's own count is held to at
    least this, so an engine that answers too little cannot size a request below what its bytes are."""
    return _prompt_count(body, bytes_floor, 0)


def prompt_tokens_ceiling(body: ChatRequest | CompletionRequest) -> int:
    """The most prompt tokens ``body`` can be, whoever counts it: one per UTF-8 byte of everything the estimate
    counts (a byte-level tokenizer never gives more: its fallback is one token a byte), plus what a chat
    template adds (``TEMPLATE_TOKENS_PER_MESSAGE_MAX`` a message, ``TEMPLATE_TOKENS_MAX`` in all). An engine
    count above it is not believed (``fairgate.gateway.tokenizer``)."""
    return _prompt_count(body, _utf8_bytes, TEMPLATE_TOKENS_PER_MESSAGE_MAX) + TEMPLATE_TOKENS_MAX


def _utf8_bytes(text: str) -> int:
    return len(text.encode("utf-8"))


def _prompt_count(body: ChatRequest | CompletionRequest, count: Callable[[str], int], per_message: int) -> int:
    """``count`` of each text of ``body`` the upstream reads as prompt, plus ``per_message`` per chat message."""
    unknown = count(json.dumps(body.model_extra)) if body.model_extra else 0
    if isinstance(body, ChatRequest):
        tokens = sum(count(m.text()) + count(other_parts(m)) + per_message for m in body.messages)
        return tokens + count(prompt_extras(body)) + unknown
    text = body.prompt_text()
    return (count(text) if text is not None else len(body.prompt_token_ids())) + unknown


def other_parts(message: ChatMessage) -> str:
    """A message's content parts other than text (images, audio, files: their data is sent), as JSON."""
    if not isinstance(message.content, list):
        return ""
    parts = [part.model_dump() for part in message.content if part.type != "text" or part.model_extra]
    return json.dumps(parts) if parts else ""


def prompt_extras(body: ChatRequest) -> str:
    """The text a chat body gives the model besides its messages' content, as JSON (empty for plain
    messages): tool definitions, a response schema, and each message's other fields (tool calls, names)."""
    extra = {name: value for name in PROMPT_FIELDS if (value := getattr(body, name, None)) is not None}
    messages = [  # each message's fields besides role and content: name, tool_calls, ...
        fields for m in body.messages if (fields := {k: v for k, v in (m.model_extra or {}).items() if v is not None})
    ]
    if messages:
        extra["messages"] = messages
    return json.dumps(extra) if extra else ""


def count_embedding_tokens(body: EmbeddingRequest) -> int:
    """The input tokens the emulated replica counts for an embeddings request: words of each text, one per
    token id, summed over the inputs."""
    return sum(count_tokens(item) if isinstance(item, str) else len(item) for item in body.items())


def estimate_embedding_tokens(body: EmbeddingRequest) -> list[int]:
    """The gateway's admission estimate of each input of an embeddings request (``estimate_tokens`` of a
    text, one per token id); fields the gateway does not know add to the first, as they do to a prompt."""
    counts = [estimate_tokens(item) if isinstance(item, str) else len(item) for item in body.items()]
    if body.model_extra:
        counts[0] += estimate_tokens(json.dumps(body.model_extra))
    return counts
