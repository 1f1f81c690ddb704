"""The emulated replica's OpenAI-compatible HTTP API (FastAPI): chat completions, completions, embeddings
(``fairgate.emulator.embeddings``), models, and vLLM's tokenize.

Follows the OpenAI API and vLLM's extensions where they matter for scheduling: ``max_tokens`` (or
``max_completion_tokens``), ``stream`` with ``stream_options.include_usage``, ``seed``, and vLLM's
``ignore_eos`` (generate exactly ``max_tokens``). Without ``ignore_eos`` the output length is drawn from
the emulator's length distribution (seeded by ``seed`` when given) and capped by ``max_tokens``.

Prompt tokens are counted by ``fairgate.api.count_prompt_tokens``: one token per whitespace-separated
word, plus 3 per chat message (the role and template markers). Generated text is `` t1 t2 ...``. A client
that disconnects stops its sequence within one iteration. Bad requests get HTTP 400 with an OpenAI-shaped
error naming the field.

``n`` choices are ``n`` sequences in the batch, each with its own output length (drawn in turn from one
random source, seeded by ``seed`` when given); they share the prompt, which is prefilled once (the first
sequence carries it, as vLLM's parallel sampling shares its prompt's KV cache). Their tokens are told apart
by ``index``; usage counts the prompt once and the output of every choice.

With ``require_tenant_context`` the emulator stands in for an upstream that refuses work without trusted
tenant context (seed 003, "each hop in the backend receives trusted tenant context and rejects when
missing"): a generation request without a non-empty string ``cache_salt`` (vLLM's per-tenant prefix-cache
salt, which the gateway always sets) is answered 400 with ``param`` ``cache_salt``.

With ``prefix_caching`` the replica reuses cached prompt blocks as vLLM's automatic prefix caching does
(https://docs.vllm.ai/en/latest/design/prefix_caching.html; ``fairgate.emulator.replica``), scoped by
``cache_salt``: the prompt is rendered as the tokens ``count_prompt_tokens`` counts (``prompt_token_list``),
hashed a block at a time, and the usage reports the tokens found cached as OpenAI's API and vLLM (with
``--enable-prompt-tokens-details``) do: ``"prompt_tokens_details": {"cached_tokens": N}``. Without it the
usage has no ``prompt_tokens_details``.

``POST /tokenize`` is vLLM's (``TokenizeChatRequest``: ``model``, ``messages``; ``TokenizeCompletionRequest``:
``model``, ``prompt``), so the gateway can size a request by the replica's own count
(``fairgate.gateway.tokenizer``): it answers ``{"count", "max_model_len", "tokens", "token_strs"}`` with the
tokens of ``prompt_token_list``, so its count is the ``prompt_tokens`` of the usage. A word's id is 31 bits of
its BLAKE2b hash; ``token_strs`` (the words) only when ``return_token_strs`` is true. ``add_generation_prompt``
and ``add_special_tokens`` change nothing: the replica's usage counts no generation prompt and no BOS.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fairgate.api import ChatRequest, CompletionRequest, GenerationRequest, count_prompt_tokens, error_body
from fairgate.core.cost import CostModel
from fairgate.emulator import embeddings
from fairgate.emulator.replica import EmulatedReplica, Sequence, block_hashes


class EmulatorSettings(BaseModel):
    """What the emulated replica is: its cost model, model name, output lengths and context length."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)
    model: Annotated[str, Field(min_length=1, max_length=200)] = "fairgate-emulated"
    iter_base_ms: Annotated[float, Field(ge=0.001, le=1e5)] = 9.0
    iter_slope_ms: Annotated[float, Field(ge=0, le=1e4)] = 0.55
    prefill_ms_per_token: Annotated[float, Field(ge=0, le=1e3)] = 0.06
    max_batch: Annotated[int, Field(ge=1, le=100_000)] = 24
    output_mean_tokens: Annotated[float, Field(ge=1, le=1e6)] = 128.0
    output_cv: Annotated[float, Field(ge=0, le=10)] = 0.5
    max_model_len: Annotated[int, Field(ge=2, le=10_000_000)] = 32_768
    require_tenant_context: bool = False  # refuse generation requests without a cache_salt (400)
    embedding_dimensions: Annotated[int, Field(ge=1, le=65_536)] = 64  # length of its embedding vectors
    prefix_caching: bool = False  # reuse cached prompt blocks per cache_salt and report cached_tokens

    def cost(self) -> CostModel:
        return CostModel(self.iter_base_ms, self.iter_slope_ms, self.prefill_ms_per_token, self.max_batch)


# A chat message's template markers (ChatML's): with its role, the CHAT_MESSAGE_OVERHEAD_TOKENS (3) tokens
# ``count_prompt_tokens`` adds a message.
_CHAT_START, _CHAT_END = "<|im_start|>", "<|im_end|>"


def prompt_token_list(body: ChatRequest | CompletionRequest) -> list[str | int]:
    """The prompt as the emulated replica's tokens, exactly those ``count_prompt_tokens`` counts (one per
    whitespace-separated word; a chat message adds its template markers: start, role, end; a prompt of
    token ids is those ids), so ``len(prompt_token_list(body)) == count_prompt_tokens(body)``. The prefix
    cache hashes these (``block_hashes``)."""
    if isinstance(body, ChatRequest):
        tokens: list[str | int] = []
        for message in body.messages:
            tokens += [_CHAT_START, message.role, *message.text().split(), _CHAT_END]
        return tokens
    text = body.prompt_text()
    return list(text.split()) if text is not None else list(body.prompt_token_ids())


def _error(status: int, message: str, param: str | None, code: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(message, "invalid_request_error", param, code))


@dataclass
class EmulatorState:
    """An emulator app's state: its settings, the shared random source of output lengths, and the replica
    (running while the app is up)."""

    settings: EmulatorSettings
    rng: random.Random = field(default_factory=random.Random)
    replica: EmulatedReplica | None = None

    def running(self) -> EmulatedReplica:
        assert self.replica is not None, "the emulator's lifespan has not started"
        return self.replica


def replica_of(app: FastAPI) -> EmulatedReplica:
    """The running replica of an emulator app (for tests and drills holding the app)."""
    state = app.state.emulator
    assert isinstance(state, EmulatorState), "not an app of create_app"
    return state.running()


def create_app(settings: EmulatorSettings | None = None) -> FastAPI:
    """The emulator's ASGI app; the replica loop runs while the app is up (lifespan)."""
    state = EmulatorState(settings or EmulatorSettings())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.replica = EmulatedReplica(state.settings.cost(), prefix_caching=state.settings.prefix_caching)
        state.replica.start()
        yield
        await state.replica.stop()

    app = FastAPI(title="fairgate emulated replica", lifespan=lifespan)
    app.state.emulator = state

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        location = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(location) or None
        return _error(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatRequest) -> Any:
        return await _generate(state, request, body, count_prompt_tokens(body), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Any:
        return await _generate(state, request, body, count_prompt_tokens(body), chat=False)

    @app.post("/v1/embeddings")
    async def embed(request: Request, body: embeddings.EmbeddingRequest) -> Any:
        settings = state.settings
        return await embeddings.serve(
            state.running(), request, body, settings.embedding_dimensions, settings.max_model_len
        )

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        return await _tokenize(request, state.settings)

    _install_info_routes(app, state)
    return app


async def _tokenize(request: Request, settings: EmulatorSettings) -> dict[str, Any]:
    """vLLM's ``POST /tokenize`` of a chat (``messages``) or a prompt (module docstring). Raises
    ``RequestValidationError`` (400 naming the field)."""
    try:
        document = await request.json()
    except ValueError:
        document = None
    if not isinstance(document, dict):
        raise RequestValidationError([{"loc": ("body",), "msg": "expected a JSON object", "type": "dict_type"}])
    try:  # the generation endpoints' own models: the same fields, counted the same way
        body = (ChatRequest if "messages" in document else CompletionRequest).model_validate(document)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
    tokens = prompt_token_list(body)
    return {
        "count": len(tokens),
        "max_model_len": settings.max_model_len,
        "tokens": [t if isinstance(t, int) else _token_id(t) for t in tokens],
        "token_strs": [str(t) for t in tokens] if document.get("return_token_strs") is True else None,
    }


def _token_id(word: str) -> int:
    """A word's token id: 31 bits of its BLAKE2b hash, the same in every process."""
    return int.from_bytes(hashlib.blake2b(word.encode("utf-8", "surrogatepass"), digest_size=4).digest(), "big") >> 1


def _install_info_routes(app: FastAPI, state: EmulatorState) -> None:
    settings = state.settings

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = {"id": settings.model, "object": "model", "created": 0, "owned_by": "fairgate"}
        return {"object": "list", "data": [{**model, "max_model_len": settings.max_model_len}]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        """vLLM's load gauges (the emulator speaks vLLM's dialect): requests in the running batch and
        queued for a slot, labelled by model, in Prometheus's text format."""
        replica = state.running()
        registry = CollectorRegistry()
        for name, text, value in (
            ("vllm:num_requests_running", "Requests in the running batch.", replica.running),
            ("vllm:num_requests_waiting", "Requests waiting for a slot.", replica.waiting),
        ):
            Gauge(name, text, ["model_name"], registry=registry).labels(settings.model).set(value)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/emulator/stats")
    async def stats() -> dict[str, Any]:
        replica = state.running()
        recent = list(replica.iterations)
        return {
            "running": replica.running,
            "waiting": replica.waiting,
            "busy_ms": replica.busy_ms,
            "tokens_generated": replica.tokens_generated,
            "sequences_finished": replica.sequences_finished,
            "sequences_cancelled": replica.sequences_cancelled,
            "iterations": len(recent),
            "planned_ms": sum(i.planned_ms for i in recent),
            "measured_ms": sum(i.measured_ms for i in recent),
            "charge_rule_ms_by_cache_salt": dict(replica.charged_ms_by_salt),
        }


def output_length(
    settings: EmulatorSettings,
    shared_rng: random.Random,
    body: GenerationRequest,
    prompt_tokens: int,
    rng: random.Random | None = None,
) -> tuple[int, str] | JSONResponse:
    """The output length and finish reason of a request (a lognormal draw from ``rng``, else from ``seed``'s
    or the shared source; capped), or the 400 answer."""
    cap = body.token_cap()
    if cap is not None and prompt_tokens + cap > settings.max_model_len:
        return _error(
            400,
            f"This model's maximum context length is {settings.max_model_len} tokens; the "
            f"prompt has {prompt_tokens} and max_tokens asks for {cap}.",
            "max_tokens",
            "context_length_exceeded",
        )
    if prompt_tokens >= settings.max_model_len:
        return _error(
            400,
            f"The prompt has {prompt_tokens} tokens; the context is {settings.max_model_len}.",
            "messages",
            "context_length_exceeded",
        )
    if body.ignore_eos and cap is not None:
        return cap, "length"
    rng = rng or (random.Random(body.seed) if body.seed is not None else shared_rng)
    sigma2 = math.log1p(settings.output_cv**2)
    mu = math.log(settings.output_mean_tokens) - sigma2 / 2
    length = max(1, round(rng.lognormvariate(mu, math.sqrt(sigma2))))
    length = min(length, settings.max_model_len - prompt_tokens)
    if cap is not None and length >= cap:
        return cap, "length"
    return length, "stop"


async def _generate(
    state: EmulatorState, request: Request, body: GenerationRequest, prompt_tokens: int, chat: bool
) -> Any:
    salt = (body.model_extra or {}).get("cache_salt")
    salt = salt if isinstance(salt, str) else None
    if state.settings.require_tenant_context and (salt is None or not salt.strip()):
        return _error(
            400,
            "cache_salt: this replica requires tenant context (a non-empty cache_salt).",
            "cache_salt",
            "missing_tenant_context",
        )
    rng = random.Random(body.seed) if body.seed is not None else state.rng
    decided = [output_length(state.settings, state.rng, body, prompt_tokens, rng) for _ in range(body.n)]
    lengths = [d for d in decided if not isinstance(d, JSONResponse)]
    if len(lengths) < len(decided):
        return next(d for d in decided if isinstance(d, JSONResponse))
    replica = state.running()
    caching = state.settings.prefix_caching
    blocks: tuple[int, ...] = ()
    if caching and isinstance(body, ChatRequest | CompletionRequest):
        blocks = block_hashes(prompt_token_list(body))
    # The prompt is shared: the first sequence prefills it, the others join it unprefilled.
    seqs = [
        replica.submit(prompt_tokens, n, salt, blocks) if i == 0 else replica.submit(0, n, salt)
        for i, (n, _) in enumerate(lengths)
    ]
    reasons = [reason for _, reason in lengths]
    reply = _Reply(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()), body.model, chat)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _stream(replica, seqs, reply, prompt_tokens, reasons, include_usage, caching),
            media_type="text/event-stream",
        )
    watcher = asyncio.create_task(_cancel_on_disconnect(request, replica, seqs))
    try:
        async for _ in _merged(seqs):
            pass
    finally:
        watcher.cancel()
    if any(seq.cancelled for seq in seqs):
        return _error(499, "client closed the request", None, "cancelled")
    choices = []
    for index, seq in enumerate(seqs):
        text = "".join(f" t{i}" for i in range(1, seq.generated + 1))
        choice: dict[str, Any] = {"index": index, "finish_reason": reasons[index], "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choices.append(choice)
    return {**reply.head(), "choices": choices, "usage": _usage(prompt_tokens, seqs, caching)}


async def _merged(seqs: list[Sequence]) -> AsyncIterator[tuple[int, int | None]]:
    """The events of ``seqs`` as they come: ``(index, token)``, and ``(index, None)`` when one ends."""
    pending = {asyncio.ensure_future(seq.events.get()): index for index, seq in enumerate(seqs)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):  # one iteration's tokens in index order
                index = pending.pop(task)
                token = task.result()
                if token is not None:
                    pending[asyncio.ensure_future(seqs[index].events.get())] = index
                yield index, token
    finally:
        for task in pending:
            task.cancel()


@dataclass(frozen=True)
class _Reply:
    """What every document of one reply repeats."""

    ident: str
    created: int
    model: str
    chat: bool

    def head(self, chunk: bool = False) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.ident, "object": kind, "created": self.created, "model": self.model}


def _usage(prompt_tokens: int, seqs: list[Sequence], cache_details: bool) -> dict[str, Any]:
    """The usage of a reply (tokens); with ``cache_details``, the prompt tokens found in the prefix cache as
    OpenAI's API reports them (``prompt_tokens_details.cached_tokens``: the first sequence carries the
    prompt)."""
    generated = sum(seq.generated for seq in seqs)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": prompt_tokens + generated,
    }
    if cache_details:
        usage["prompt_tokens_details"] = {"cached_tokens": seqs[0].cached_tokens}
    return usage


async def _cancel_on_disconnect(request: Request, replica: EmulatedReplica, seqs: list[Sequence]) -> None:
    while not all(seq.finished or seq.cancelled for seq in seqs):
        if await request.is_disconnected():
            for seq in seqs:
                replica.cancel(seq)
            return
        await asyncio.sleep(0.02)


async def _stream(
    replica: EmulatedReplica,
    seqs: list[Sequence],
    reply: _Reply,
    prompt_tokens: int,
    reasons: list[str],
    include_usage: bool,
    cache_details: bool,
) -> AsyncIterator[str]:
    chat = reply.chat

    def chunk(index: int, delta_text: str | None, finish: str | None, role: bool = False) -> str:
        if chat:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": ""}
                if role
                else ({"content": delta_text} if delta_text is not None else {})
            )
            choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": index, "text": delta_text or "", "finish_reason": finish, "logprobs": None}
        body = {**reply.head(chunk=True), "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"

    try:
        if chat:
            for index in range(len(seqs)):
                yield chunk(index, None, None, role=True)
        async for index, token in _merged(seqs):
            if token is not None:
                yield chunk(index, f" t{token}", None)
            elif not seqs[index].cancelled:
                yield chunk(index, None if chat else "", reasons[index])
        if include_usage:
            body = {**reply.head(chunk=True), "choices": [], "usage": _usage(prompt_tokens, seqs, cache_details)}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for seq in seqs:
            replica.cancel(seq)  # a no-op once finished; stops the sequence if the client went away
