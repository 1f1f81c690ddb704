"""Intake, the first stage of the request path: headers and body in, a typed ``Generation`` out.

Reads the request id (``X-Request-Id`` or ``Idempotency-Key``; generated when absent, echoed as
``x-request-id``), the agent-run headers, and the body (size bound, JSON, the OpenAI schema of
``fairgate.api``), then sizes the request against its model (an alias or a plain model,
``fairgate.gateway.aliases``): the model must exist (404), the prompt fit the smallest context of the
upstreams of all its pools (413; a fallback pool must be able to take it too), ``max_tokens`` plus the prompt
too (400), and every field must be one its upstreams' kind forwards (400 naming the field:
``fairgate.gateway.kinds``, e.g. llama.cpp's ``n_predict``, which would bypass ``max_tokens``); the prompt is
counted by an engine of the model where one can (``fairgate.gateway.tokenizer``: its tokenizer and chat
template), else estimated (``fairgate.api.estimate_prompt_tokens``), and the GPU time reserved for it is the
most any of those upstreams' cost models can charge it (``CostModel.worst_case_ms``: prefill, and
``max_tokens`` decoded at a batch of one), so that a GPU budget is a bound, not a hope. Every refusal is a
``Rejection`` naming the field.

``n`` choices (``n`` > 1) are ``n`` sequences: ``n`` slots (refused, 400 ``n``, above the smallest
``max_batch`` of the model's upstreams: they must fit one upstream at once), ``n * max_tokens`` output
reserved and ``n`` times the GPU estimate (an upstream may prefill each sequence; one that shares the prompt
is billed less at settlement). An embeddings request (``size_up_embedding``) is one sequence that is only
prefilled: its inputs estimated, no output, and the GPU time of its prefill plus one decode share at a batch
of one (the replica runs it in one iteration's slot, so the charge rule charges it ``dt / B`` of that
iteration too).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from fairgate.api import (
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    GenerationRequest,
    estimate_embedding_tokens,
    estimate_prompt_tokens,
    prompt_tokens_floor,
)
from fairgate.core.cost import CostModel
from fairgate.gateway import jsonbody, kinds
from fairgate.gateway.aliases import ServedModel
from fairgate.gateway.config import GatewayConfig, UpstreamConfig
from fairgate.gateway.outcomes import Outcome, Rejection

RUN_ID_HEADER = "x-fairgate-run-id"  # an agent run's id: its calls count against the run limits
TOOL_ROUND_HEADER = "x-fairgate-tool-round"
ID_LENGTH_MAX = 200
Body = TypeVar("Body", bound=BaseModel)


@dataclass(frozen=True)
class Run:
    """The agent run a call belongs to (the client names its own run; the run limits only restrict it)."""

    run_id: str | None = None
    tool_round: bool = False


@dataclass(frozen=True)
class Generation:
    """A chat, completion or embeddings request, read and sized.

    Attributes:
        request_id: the client's id, or a generated one.
        chat: a chat completion (else a text completion, or embeddings).
        body: the validated body.
        model: the model asked for (an alias or a plain model; the name answers carry).
        run: its agent run.
        prompt_tokens: the prompt, as an engine counted it or estimated (an embeddings request: its inputs,
            estimated).
        max_tokens: the output cap over all its sequences (the client's per choice, or the default within
            the context, times ``sequences``); 0 for embeddings.
        gpu_ms_estimate: GPU ms reserved for it.
        cost: the cost model of the model's upstream whose worst case is the estimate.
        model_class: the ledger's model class it is reserved and charged in (the alias's ``quota_class``;
            default: ``model``).
        pools: the pools that may serve it, primary first (default: ``(model,)``).
        sequences: the sequences it runs, one slot each (``n``).
        prompt_tokens_max: the most prompt tokens an upstream that serves it can have read: its largest
            context (an embeddings request: times its inputs). An upstream's usage above this is not believed
            (``usage_rule``).
        prompt_tokens_estimated: the gateway's own estimate of the prompt (``estimate_prompt_tokens``), whoever
            counted ``prompt_tokens``: an upstream's usage far below it is not believed (``usage_rule``).
    """

    request_id: str
    chat: bool
    body: ChatRequest | CompletionRequest | EmbeddingRequest
    model: str
    run: Run
    prompt_tokens: int
    max_tokens: int
    gpu_ms_estimate: float
    cost: CostModel
    model_class: str = ""
    pools: tuple[str, ...] = ()
    sequences: int = 1
    prompt_tokens_max: int = 0  # never below the estimate (``__post_init__``)
    prompt_tokens_estimated: int = 0  # 0: ``prompt_tokens`` is the estimate (``__post_init__``)

    def __post_init__(self) -> None:
        # A generation built without them (a plain model) is its own class and pool.
        object.__setattr__(self, "model_class", self.model_class or self.model)
        object.__setattr__(self, "pools", self.pools or (self.model,))
        object.__setattr__(self, "prompt_tokens_max", max(self.prompt_tokens_max, self.prompt_tokens))
        object.__setattr__(self, "prompt_tokens_estimated", self.prompt_tokens_estimated or self.prompt_tokens)

    @property
    def stream(self) -> bool:
        """The client asked for a stream."""
        return isinstance(self.body, GenerationRequest) and self.body.stream

    @property
    def embedding(self) -> bool:
        return isinstance(self.body, EmbeddingRequest)


def one_header(request: Request, name: str) -> str | None:
    """The header ``name``, given at most once. Raises ``Rejection`` 400 naming it."""
    values = request.headers.getlist(name)
    if len(values) > 1:
        raise Rejection(Outcome.INVALID_REQUEST, f"{name} given {len(values)} times; send it once.", name)
    return values[0] if values else None


def printable_id(value: str) -> bool:
    """A request or run id as a header carries it: 1-200 printable ASCII characters, not only spaces (raw
    bytes beyond ASCII arrive decoded as Latin-1, and would be stored garbled)."""
    return 0 < len(value) <= ID_LENGTH_MAX and value.isascii() and value.isprintable() and bool(value.strip())


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def lenient_request_id(request: Request) -> str:
    """The request's ``X-Request-Id`` when it is a valid id, else a new one: for answers off the generation
    routes, which do not refuse a request for its id."""
    given = request.headers.get("x-request-id")
    return given if given is not None and printable_id(given) else new_request_id()


def request_id_of(request: Request) -> str:
    """The request's id: ``X-Request-Id`` or ``Idempotency-Key`` (the same if both), else a new one."""
    request_id, key = one_header(request, "x-request-id"), one_header(request, "idempotency-key")
    if request_id is not None and key is not None and request_id != key:
        raise Rejection(
            Outcome.INVALID_REQUEST_ID,
            "X-Request-Id and Idempotency-Key differ; send one (or the same value).",
            "x-request-id",
        )
    given = request_id if request_id is not None else key
    if given is None:
        return new_request_id()
    if not printable_id(given):
        raise Rejection(
            Outcome.INVALID_REQUEST_ID,
            "X-Request-Id / Idempotency-Key must be 1-200 printable ASCII characters.",
            "x-request-id" if request_id is not None else "idempotency-key",
        )
    return given


def names_its_id(request: Request) -> bool:
    """Whether the client named the request's id (``X-Request-Id`` or ``Idempotency-Key``): it may be a retry."""
    return "x-request-id" in request.headers or "idempotency-key" in request.headers


def run_of(request: Request) -> Run:
    """The agent run of ``x-fairgate-run-id`` and ``x-fairgate-tool-round: 1``. Raises ``Rejection`` 400."""
    run_id = one_header(request, RUN_ID_HEADER)
    if run_id is not None and not printable_id(run_id):
        raise Rejection(
            Outcome.INVALID_RUN_ID, f"{RUN_ID_HEADER} must be 1-200 printable ASCII characters.", RUN_ID_HEADER
        )
    flag = (one_header(request, TOOL_ROUND_HEADER) or "0").strip().lower()
    if flag not in ("0", "1", "true", "false"):
        raise Rejection(
            Outcome.INVALID_TOOL_ROUND, f"{TOOL_ROUND_HEADER} must be 0 or 1 (or false / true).", TOOL_ROUND_HEADER
        )
    if flag in ("1", "true") and run_id is None:
        raise Rejection(Outcome.INVALID_TOOL_ROUND, f"{TOOL_ROUND_HEADER} needs {RUN_ID_HEADER}.", TOOL_ROUND_HEADER)
    return Run(run_id, flag in ("1", "true"))


async def read_body(request: Request, schema: type[Body], limit_bytes: int) -> Body:
    """The body, at most ``limit_bytes``, as ``schema`` (``fairgate.api``). Raises ``Rejection`` 400/413."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        raise Rejection(Outcome.BODY_TOO_LARGE, f"Request body is {declared} bytes; the limit is {limit_bytes}.")
    raw = bytearray()
    try:
        async for piece in request.stream():
            raw += piece
            if len(raw) > limit_bytes:
                raise Rejection(Outcome.BODY_TOO_LARGE, f"Request body exceeds {limit_bytes} bytes.")
    except ClientDisconnect:
        raise Rejection(Outcome.CLIENT_CLOSED, "client closed the request while sending it") from None
    try:
        data = jsonbody.decode(bytes(raw))
    except jsonbody.BodyError as exc:
        raise Rejection(Outcome.INVALID_JSON, str(exc), exc.param) from None
    problem = jsonbody.unsendable(data)
    if problem is not None:
        raise Rejection(Outcome.INVALID_REQUEST, f"{problem[0] or 'body'}: {problem[1]}", problem[0] or None)
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc) from None


def _invalid(exc: ValidationError) -> Rejection:
    """The first schema error as a ``Rejection`` naming its field."""
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"] if not _is_type_tag(p)) or None
    message = first["msg"].removeprefix("Value error, ")
    named = re.match(r"([^\s:]+): (.*)", message, re.DOTALL) if first["type"] == "value_error" else None
    if named:  # a check across fields names the one at fault first ("top_logprobs: needs logprobs"), a check
        # of a nested object the path under it ("tools.0.functon", "content.0.type" under "messages.0")
        param = f"{param}.{named.group(1)}" if param else named.group(1)
        message = named.group(2)
    return Rejection(Outcome.INVALID_REQUEST, f"{param or 'body'}: {message}", param)


def _is_type_tag(part: object) -> bool:
    """pydantic's union-branch markers in an error location (``str``, ``list[ContentPart]``, ...)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def size_up(
    config: GatewayConfig,
    body: ChatRequest | CompletionRequest,
    chat: bool,
    request_id: str,
    run: Run,
    counted: int | None = None,
) -> Generation:
    """``body`` against its model's upstreams (see module docstring); ``counted``: its prompt tokens as an
    engine of the model counted them (``fairgate.gateway.tokenizer``), held to at least
    ``prompt_tokens_floor``; None: estimated. Raises ``Rejection`` 400/404/413."""
    served, serving, context = _serving(config, body.model)
    estimated = estimate_prompt_tokens(body)
    prompt_tokens = estimated if counted is None else max(counted, prompt_tokens_floor(body))
    if prompt_tokens >= context:
        raise Rejection(
            Outcome.PROMPT_TOO_LONG,
            f"The prompt has {prompt_tokens} tokens; the model's context is {context}.",
            "messages" if chat else "prompt",
        )
    max_tokens = body.token_cap() or min(config.gateway.default_max_tokens, context - prompt_tokens)
    if prompt_tokens + max_tokens > context:
        raise Rejection(
            Outcome.OUTPUT_TOO_LONG,
            f"max_tokens {max_tokens} plus the prompt's {prompt_tokens} tokens exceed the context of {context}.",
            "max_tokens",
        )
    refused = kinds.refusal([u.engine for u in serving], body.model_dump(exclude_unset=True), chat)
    if refused is not None:  # nothing is reserved for a request the upstream could run unmetered
        raise Rejection(Outcome.INVALID_REQUEST, refused[1], refused[0])
    slots = min(u.max_batch for u in serving)
    if body.n > slots:  # its n sequences must fit one upstream's batch at once
        raise Rejection(
            Outcome.INVALID_REQUEST, f"n: {body.n} choices exceed the {slots} sequences an upstream runs at once.", "n"
        )
    cost = max((u.cost for u in serving), key=lambda c: c.worst_case_ms(prompt_tokens, max_tokens))
    estimate = body.n * cost.worst_case_ms(prompt_tokens, max_tokens)
    return Generation(
        request_id,
        chat,
        body,
        body.model,
        run,
        prompt_tokens,
        body.n * max_tokens,
        estimate,
        cost,
        served.quota_class,
        served.pools,
        body.n,
        max(u.max_model_len for u in serving),
        estimated,
    )


def size_up_embedding(config: GatewayConfig, body: EmbeddingRequest, request_id: str, run: Run) -> Generation:
    """An embeddings request against its model's upstreams: each input within the context (413 ``input``);
    reserved: the inputs' estimate, no output, the GPU time of its prefill and one decode share (see module
    docstring); a field OpenAI's embeddings API does not have is refused (400 naming it). Raises ``Rejection``
    400/404/413."""
    unknown = sorted(name for name, value in (body.model_extra or {}).items() if value is not None)
    if unknown:  # forwarded to no engine: a silent drop would hide a client's mistake
        raise Rejection(
            Outcome.INVALID_REQUEST, f"{unknown[0]}: not a field of an embeddings request.", unknown[0][:100]
        )
    served, serving, context = _serving(config, body.model)
    counts = estimate_embedding_tokens(body)
    longest = max(range(len(counts)), key=counts.__getitem__)
    if counts[longest] > context:
        raise Rejection(
            Outcome.PROMPT_TOO_LONG,
            f"input {longest} has {counts[longest]} tokens; the model's context is {context}.",
            "input",
        )
    tokens = sum(counts)
    cost = max((u.cost for u in serving), key=lambda c: c.worst_case_ms(tokens, 1))
    estimate = cost.worst_case_ms(tokens, 1)
    prompt_tokens_max = len(counts) * max(u.max_model_len for u in serving)
    return Generation(
        request_id,
        False,
        body,
        body.model,
        run,
        tokens,
        0,
        estimate,
        cost,
        served.quota_class,
        served.pools,
        prompt_tokens_max=prompt_tokens_max,
    )


def _serving(config: GatewayConfig, model: str) -> tuple[ServedModel, list[UpstreamConfig], int]:
    """The model a request names (an alias or a plain model), the upstreams of all its pools and the
    smallest context among them. Raises ``Rejection`` 404 when no upstream serves it."""
    served = config.served.get(model)
    serving = config.upstreams_for(model)
    if served is None or not serving:
        raise no_model(model)
    return served, serving, min(u.max_model_len for u in serving)


def no_model(model: str) -> Rejection:
    """404 ``model_not_found`` for ``model``."""
    return Rejection(Outcome.MODEL_NOT_FOUND, f"The model {model[:100]!r} does not exist.", "model")
