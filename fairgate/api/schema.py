"""The OpenAI wire schema both sides of fairgate speak: chat, completion and embedding request bodies.

Follows the OpenAI API (platform.openai.com/docs/api-reference/chat/create) and vLLM's extensions where
they matter for scheduling: ``max_tokens`` (or ``max_completion_tokens``), ``stream`` with
``stream_options.include_usage``, ``seed``, and vLLM's ``ignore_eos``. Known fields must have their type
and range (a request vLLM would refuse is refused here, naming the field); unknown fields are kept
(``model_extra``): the gateway then forwards only those its upstream's kind takes and refuses the rest
(``fairgate.gateway.kinds``); the emulator ignores them.

Inside the top level, a misspelt key changes what a request does without any error (``stream_options:
{"include_usagee": true}`` ends the stream without its usage), so nested objects are checked too, each error
naming its path (``stream_options.include_usagee``, ``tools.0.functon``): closed where OpenAI's API and the
engines agree on a closed set (``stream_options``; ``tool_choice``; ``tools``: each a ``function`` or
``custom`` tool and a function's ``name`` / ``description`` / ``parameters`` / ``strict``;
``response_format.type``); where the engines take more than OpenAI defines (a message's fields, which vLLM
passes to the chat template; content part types, which vLLM, SGLang and llama.cpp extend), only a near miss
of a known name is refused (``near_miss``: ``contnet``, ``txt``), and a text part must carry its ``text``.
The objects stay as the client sent them (``model_extra``, forwarded as they are). The gateway validates
what clients send with these models; the emulated replica serves them.

``n`` (chat and completions) asks for that many choices of one prompt, at most ``N_MAX`` (OpenAI's bound).
Embeddings (platform.openai.com/docs/api-reference/embeddings/create): ``input`` is a string, a list of
strings, a list of token ids or a list of token-id lists - never empty, at most ``EMBEDDING_INPUTS_MAX``
items (OpenAI's bound); ``encoding_format`` ``float`` or ``base64``; ``dimensions`` >= 1.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping
from typing import Annotated, Any, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Open(BaseModel):
    # OpenAI clients send many optional fields: unknown ones are passed on, known ones must have their type
    # ("5" is not a max_tokens, "yes" is not a stream flag).
    model_config = ConfigDict(extra="allow", strict=True)


# How close a name must be to a known one to be taken for its misspelling (difflib's ratio, on lower case):
# 0.85 refuses "txt" (text, 0.86), "contnet" (content, 0.86), "imag_url", and lets "image_file" (image_pil,
# 0.84), "input_video" (input_audio, 0.73) or "audio" through to the engine, which knows its own names.
NEAR_MISS_RATIO = 0.85


def near_miss(name: str, known: Collection[str]) -> str | None:
    """The known name ``name`` most likely misspells (another case, or within ``NEAR_MISS_RATIO``); None when
    ``name`` is known or like none of them (an engine's own name, passed on)."""
    if name in known:
        return None
    lower = name.lower()
    if lower in known:
        return lower
    close = difflib.get_close_matches(lower, sorted(known), n=1, cutoff=NEAR_MISS_RATIO)
    return close[0] if close else None


def _named(name: object) -> str:
    """A client's key as an error names it (bounded: it is the client's text)."""
    return str(name)[:100]


class StreamOptions(_Open):
    """OpenAI's stream options (``openai.types.chat.ChatCompletionStreamOptionsParam``): a closed set. The
    gateway asks its upstream for usage itself (``stream_options`` is replaced), so an engine's own option
    (vLLM's ``continuous_usage_stats``) would be dropped: it is refused, as is a misspelling."""

    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI's; no engine obfuscates, so it changes nothing here

    @model_validator(mode="after")
    def _closed(self) -> StreamOptions:
        for name in self.model_extra or {}:
            raise ValueError(f"{_named(name)}: not a stream option (include_usage, include_obfuscation)")
        return self


# Content part types: OpenAI's (text, image_url, input_audio, file, refusal) and those vLLM's chat parser
# takes (vllm/entrypoints/chat_utils.py MM_PARSER_MAP: thinking, input_text, output_text, input_image,
# image_embeds, audio_embeds, video_embeds, prompt_embeds, image_pil, audio_url, video_url). Not a closed set:
# an engine may take others; only a near miss of one of these is refused.
PART_TYPES = frozenset(
    {
        "text",
        "image_url",
        "input_audio",
        "file",
        "refusal",
        "thinking",
        "input_text",
        "output_text",
        "input_image",
        "image_embeds",
        "audio_embeds",
        "video_embeds",
        "prompt_embeds",
        "image_pil",
        "audio_url",
        "video_url",
    }
)
# A message's fields: OpenAI's (the union of its roles' message params) and the engines' (vLLM's
# CustomChatCompletionMessageParam: reasoning, tools, task; reasoning_content, which vLLM, SGLang and
# llama-server read). Not a closed set: vLLM hands a message's other fields to the chat template.
MESSAGE_FIELDS = frozenset(
    {
        "role",
        "content",
        "name",
        "tool_calls",
        "tool_call_id",
        "function_call",
        "refusal",
        "audio",
        "reasoning",
        "reasoning_content",
        "tools",
        "task",
    }
)


class ContentPart(_Open):
    type: str
    text: str = ""


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None

    @model_validator(mode="after")
    def _no_near_misses(self) -> ChatMessage:
        """A field or a content part type one typo from a known one, or a text part without its text, is
        refused, naming it (``content.0.type``)."""
        for name in self.model_extra or {}:
            meant = near_miss(name, MESSAGE_FIELDS)
            if meant is not None:
                raise ValueError(f"{_named(name)}: not a message field; did you mean {meant!r}?")
        for index, part in enumerate(self.content if isinstance(self.content, list) else ()):
            if part.type == "text" and "text" not in part.model_fields_set:
                raise ValueError(f"content.{index}.text: a text part needs its text")
            meant = near_miss(part.type, PART_TYPES)
            if meant is not None:
                raise ValueError(
                    f"content.{index}.type: {_named(part.type)!r} is no content part type; did you mean {meant!r}?"
                )
        return self

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

    @model_validator(mode="after")
    def _tools_and_formats(self) -> ChatRequest:
        """``tool_choice``, ``tools`` and ``response_format`` (kept as sent, in ``model_extra``) have OpenAI's
        shape, an error naming the path at fault (``tools.0.functon``)."""
        extra = self.model_extra or {}
        for name, check in (
            ("tool_choice", _tool_choice_problem),
            ("tools", _tools_problem),
            ("response_format", _response_format_problem),
        ):
            problem = check(extra[name]) if extra.get(name) is not None else None
            if problem is not None:
                raise ValueError(f"{name}{problem}")
        return self


# tool_choice (openai.types.chat.ChatCompletionToolChoiceOptionParam): a mode, or an object naming a tool.
TOOL_CHOICE_MODES = ("none", "auto", "required")
TOOL_CHOICE_TYPES = ("function", "custom", "allowed_tools")
# A tool (ChatCompletionToolUnionParam) and a function's definition (shared FunctionDefinition).
TOOL_TYPES = ("function", "custom")
FUNCTION_FIELDS = ("name", "description", "parameters", "strict")
# response_format types: OpenAI's (text, json_object, json_schema), vLLM's and SGLang's structural_tag, and
# TGI's json and regex (its GrammarType, ``{"type", "value"}``); an engine refuses those it does not take.
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag", "json", "regex")
# Their other fields (json_schema; llama-server's schema; TGI's value; structural_tag's format, structures and
# triggers): not closed, but a near miss of one is refused.
RESPONSE_FORMAT_FIELDS = ("type", "json_schema", "schema", "value", "format", "structures", "triggers")


def _tool_choice_problem(value: Any) -> str | None:
    """What is wrong with a ``tool_choice``, as ``<path under it>: <why>`` (None: nothing)."""
    if isinstance(value, str):
        if value in TOOL_CHOICE_MODES:
            return None
        return f": {_named(value)!r} is none of 'none', 'auto', 'required' (or an object naming a tool)"
    if not isinstance(value, Mapping):
        return ": 'none', 'auto', 'required' or an object naming a tool"
    # vLLM takes {"function": {"name": ...}} without a type (its named tool choice defaults to a function).
    kind = value.get("type", "function" if "function" in value else None)
    if kind not in TOOL_CHOICE_TYPES:
        return ".type: one of 'function', 'custom', 'allowed_tools'"
    return _named_object_problem(value, kind, "tool choice", needs_name=kind != "allowed_tools")


def _tools_problem(value: Any) -> str | None:
    """What is wrong with ``tools``, as ``<path under it>: <why>`` (None: nothing)."""
    if not isinstance(value, list):
        return ": a list of tools"
    for index, tool in enumerate(value):
        if not isinstance(tool, Mapping):
            return f".{index}: a tool is an object"
        kind = tool.get("type", "function")  # vLLM takes a tool without a type as a function
        if kind not in TOOL_TYPES:
            return f".{index}.type: one of 'function', 'custom'"
        problem = _named_object_problem(tool, kind, "tool", needs_name=True)
        if problem is not None:
            return f".{index}{problem}"
        if kind == "function":
            for name in tool["function"]:
                if name not in FUNCTION_FIELDS:
                    return f".{index}.function.{_named(name)}: not a field of a function ({', '.join(FUNCTION_FIELDS)})"
    return None


def _named_object_problem(value: Mapping[str, Any], kind: str, what: str, needs_name: bool) -> str | None:
    """``value`` holds its ``type`` and the object that type names (``{"type": "function", "function": {...}}``),
    nothing else, and that object its ``name`` (``needs_name``)."""
    for name in value:
        if name not in ("type", kind):
            return f".{_named(name)}: not a field of a {kind} {what} (type, {kind})"
    named = value.get(kind)
    if not isinstance(named, Mapping):
        return f".{kind}: required, an object"
    if needs_name and not isinstance(named.get("name"), str):
        return f".{kind}.name: required, a string"
    return None


def _response_format_problem(value: Any) -> str | None:
    """What is wrong with a ``response_format``, as ``<path under it>: <why>`` (None: nothing)."""
    if not isinstance(value, Mapping):
        return ": an object with a type"
    if value.get("type") not in RESPONSE_FORMAT_TYPES:
        return f".type: one of {', '.join(repr(t) for t in RESPONSE_FORMAT_TYPES)}"
    for name in value:
        meant = near_miss(name, RESPONSE_FORMAT_FIELDS)
        if meant is not None:
            return f".{_named(name)}: not a field of a response format; did you mean {meant!r}?"
    return None


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
