"""Intake, the first stage of the request path: headers and body in, a typed ``Generation`` out.

Reads the request id (``X-Request-Id`` or ``Idempotency-Key``; generated when absent, echoed as
``x-request-id``), the agent-run headers, and the body (size bound, JSON, the OpenAI schema of
``fairgate.api``), then sizes the request against its model: the model must exist (404), the prompt fit
its context (413), ``max_tokens`` plus the prompt too (400), and every field must be one its upstreams'
kind forwards (400 naming the field: ``fairgate.gateway.kinds``, e.g. llama.cpp's ``n_predict``, which
would bypass ``max_tokens``); the prompt is estimated
(``fairgate.api.estimate_prompt_tokens``) and the GPU time reserved for it is the most the cost model can
charge it (``CostModel.worst_case_ms``: prefill, and ``max_tokens`` decoded at a batch of one), so that a GPU
budget is a bound, not a hope. Every refusal is a ``Rejection`` naming the field.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from fastapi import Request
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from fairgate.api import ChatRequest, CompletionRequest, estimate_prompt_tokens
from fairgate.core.cost import CostModel
from fairgate.gateway import jsonbody, kinds
from fairgate.gateway.config import GatewayConfig
from fairgate.gateway.outcomes import Outcome, Rejection

RUN_ID_HEADER = "x-fairgate-run-id"  # an agent run's id: its calls count against the run limits
TOOL_ROUND_HEADER = "x-fairgate-tool-round"
ID_LENGTH_MAX = 200


@dataclass(frozen=True)
class Run:
    """The agent run a call belongs to (the client names its own run; the run limits only restrict it)."""

    run_id: str | None = None
    tool_round: bool = False


@dataclass(frozen=True)
class Generation:
    """A chat or completion request, read and sized.

    Attributes:
        request_id: the client's id, or a generated one.
        chat: a chat completion (else a text completion).
        body: the validated body.
        model: the model asked for (the ledger's model class).
        run: its agent run.
        prompt_tokens: the estimated prompt.
        max_tokens: the output cap (the client's, or the default within the context).
        gpu_ms_estimate: GPU ms reserved for it.
        cost: the cost model of the model's upstreams.
    """

    request_id: str
    chat: bool
    body: ChatRequest | CompletionRequest
    model: str
    run: Run
    prompt_tokens: int
    max_tokens: int
    gpu_ms_estimate: float
    cost: CostModel


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


async def read_body(request: Request, chat: bool, limit_bytes: int) -> ChatRequest | CompletionRequest:
    """The body, at most ``limit_bytes``, as the OpenAI schema. Raises ``Rejection`` 400/413."""
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
        return (ChatRequest if chat else CompletionRequest).model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc) from None


def _invalid(exc: ValidationError) -> Rejection:
    """The first schema error as a ``Rejection`` naming its field."""
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"] if not _is_type_tag(p)) or None
    message = first["msg"].removeprefix("Value error, ")
    named = re.match(r"([a-z_]+): (.*)", message) if param is None else None
    if named:  # a check across fields names the one at fault first ("top_logprobs: needs logprobs")
        param, message = named.group(1), named.group(2)
    return Rejection(Outcome.INVALID_REQUEST, f"{param or 'body'}: {message}", param)


def _is_type_tag(part: object) -> bool:
    """pydantic's union-branch markers in an error location (``str``, ``list[ContentPart]``, ...)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def size_up(
    config: GatewayConfig, body: ChatRequest | CompletionRequest, chat: bool, request_id: str, run: Run
) -> Generation:
    """``body`` against its model's upstreams (see module docstring). Raises ``Rejection`` 400/404/413."""
    serving = config.upstreams_for(body.model)
    if not serving:
        raise Rejection(Outcome.MODEL_NOT_FOUND, f"The model {body.model[:100]!r} does not exist.", "model")
    context = min(u.max_model_len for u in serving)
    prompt_tokens = estimate_prompt_tokens(body)
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
    cost = serving[0].cost
    estimate = cost.worst_case_ms(prompt_tokens, max_tokens)
    return Generation(request_id, chat, body, body.model, run, prompt_tokens, max_tokens, estimate, cost)
