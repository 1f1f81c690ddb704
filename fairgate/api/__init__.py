"""The OpenAI wire contract shared by the gateway and the emulated replica: request bodies, the error body,
and prompt-token counts. Imports nothing else of fairgate (``shared/DESIGN.md``, "Layers")."""

from fairgate.api.errors import error_body
from fairgate.api.schema import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    ContentPart,
    EmbeddingRequest,
    GenerationRequest,
    StreamOptions,
    openapi_request_body,
)
from fairgate.api.tokens import (
    BYTES_PER_TOKEN_MAX,
    CHAT_MESSAGE_OVERHEAD_TOKENS,
    count_embedding_tokens,
    count_prompt_tokens,
    count_tokens,
    estimate_embedding_tokens,
    estimate_prompt_tokens,
    estimate_tokens,
    prompt_extras,
    prompt_tokens_ceiling,
    prompt_tokens_floor,
)

__all__ = [
    "BYTES_PER_TOKEN_MAX",
    "CHAT_MESSAGE_OVERHEAD_TOKENS",
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "ContentPart",
    "EmbeddingRequest",
    "GenerationRequest",
    "StreamOptions",
    "count_embedding_tokens",
    "count_prompt_tokens",
    "count_tokens",
    "error_body",
    "estimate_embedding_tokens",
    "estimate_prompt_tokens",
    "estimate_tokens",
    "openapi_request_body",
    "prompt_extras",
    "prompt_tokens_ceiling",
    "prompt_tokens_floor",
]
