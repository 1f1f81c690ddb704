"""The OpenAI wire schema both sides of fairgate speak: chat, completion and embedding request bodies.

Follows the OpenAI API (platform.openai.com/docs/api-reference/chat/create) and vLLM's extensions where
they matter for scheduling: ``max_tokens`` (or ``max_completion_tokens``), ``stream`` with
``stream_options.include_usage``, ``seed``, and vLLM's ``ignore_eos``. Known fields must have their type
and range (a request vLLM would refuse is refused here, naming the field); unknown fields are kept
(``model_extra``): the gateway then forwards only those its upstream's kind takes and refuses the rest
(``fairgate.gateway.kinds``); the emulator ignores them. The gateway validates what clients send with these models;
the emulated replica serves them.

``n`` (chat and completions) asks for that many choices of one prompt, at most ``N_MAX`` (OpenAI's bound).
Embeddings (platform.openai.com/docs/api-reference/embeddings/create): ``input`` is a string, a list of
strings, a list of token ids or a list of token-id lists - never empty, at most ``EMBEDDING_INPUTS_MAX``
items (OpenAI's bound); ``encoding_format`` ``float`` or ``base64``; ``dimensions`` >= 1.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Open(BaseModel):
    # OpenAI clients send many optional fields: unknown ones are passed on, known ones must have their type
    # ("5" is not a max_tokens, "yes" is not a stream flag).
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Open):
    include_usage: bool = False


class ContentPart(_Open):
    type: str
    text: str = ""


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return " ".join(part.text for part in self.content)


# The OpenAI API's sampling fields and their ranges (platform.openai.com/docs/api-reference/chat/create):
# the emulator ignores them, but a request vLLM would refuse is refused here too, naming the field.
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
N_MAX = 128  # choices one request may ask for (OpenAI's bound)
EMBEDDING_INPUTS_MAX = 2048  # inputs one embeddings request may carry (OpenAI's bound)


class GenerationRequest(_Open):
    model: Annotated[str, Field(min_length=1, max_length=1000)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    ignore_eos: bool = False
    n: Annotated[int, Field(ge=1, le=N_MAX)] = 1
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    stop: str | list[str] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]] | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError(f"at most 4 stop sequences, got {len(value)}")
        return value

    @model_validator(mode="after")
    def _one_cap(self) -> GenerationRequest:
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
            and "max_tokens" in self.model_fields_set
        ):
            raise ValueError("max_tokens: differs from max_completion_tokens; send one (max_completion_tokens)")
        return self

    def token_cap(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class ChatRequest(GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        return self


class CompletionRequest(GenerationRequest):
    # Text, or token ids (as OpenAI's and vLLM's completions APIs take them); one prompt a request.
    prompt: (
        str
        | list[str]
        | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
        | list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]]
    )
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # the completions API's default
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        batch = isinstance(value, list) and value and not isinstance(value[0], int)  # texts or token-id lists
        if isinstance(value, list) and not value:
            raise ValueError("an empty list is no prompt")
        if batch and len(value) != 1:
            raise ValueError(
                f"one prompt a request (a list of {len(value)} would be as many choices; send them one by one)"
            )
        return value

    def prompt_text(self) -> str | None:
        """The prompt as text, or None when it is given as token ids (``prompt_token_ids``)."""
        if isinstance(self.prompt, str):
            return self.prompt
        return self.prompt[0] if isinstance(self.prompt[0], str) else None

    def prompt_token_ids(self) -> list[int]:
        """The prompt's token ids (empty when it is text)."""
        first = self.prompt[0] if isinstance(self.prompt, list) else None
        if isinstance(first, int):
            return list(self.prompt)  # type: ignore[arg-type]
        return list(first) if isinstance(first, list) else []


EmbeddingInput: TypeAlias = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(_Open):
    """An embeddings request (see module docstring). Errors name ``input`` (with the item's index) or the
    field at fault."""

    model: Annotated[str, Field(min_length=1, max_length=1000)]
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: EmbeddingInput) -> EmbeddingInput:
        if isinstance(value, list) and not value:
            raise ValueError("an empty list is no input")
        single = isinstance(value, str) or isinstance(value[0], int)  # one text, or one token-id list
        items: list[Any] = [value] if single else list(value)
        if len(items) > EMBEDDING_INPUTS_MAX:
            raise ValueError(f"at most {EMBEDDING_INPUTS_MAX} inputs a request, got {len(items)}")
        for index, item in enumerate(items):
            where = "the input" if single else f"item {index}"
            if len(item) == 0:
                raise ValueError(f"{where} is empty")
            if isinstance(item, list) and any(token < 0 for token in item):
                raise ValueError(f"{where} has a negative token id")
        return value

    def items(self) -> list[str | list[int]]:
        """The inputs, one per vector asked for: texts or token-id lists."""
        value = self.input
        if isinstance(value, str) or isinstance(value[0], int):
            return [value]
        return list(value)


def openapi_request_body(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI ``requestBody`` for a route that parses ``model`` itself from a raw request ($defs inlined)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, list):
            return [inline(item) for item in node]
        if not isinstance(node, dict):
            return node
        rest = {key: inline(value) for key, value in node.items() if key != "$ref"}
        ref = node.get("$ref")
        return {**inline(defs[ref.rsplit("/", 1)[-1]]), **rest} if isinstance(ref, str) else rest

    return {"required": True, "content": {"application/json": {"schema": inline(schema)}}}
