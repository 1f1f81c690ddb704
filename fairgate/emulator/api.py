"""The emulated replica's OpenAI-compatible HTTP API (FastAPI): chat completions, completions, models.

Follows the OpenAI API and vLLM's extensions where they matter for scheduling: ``max_tokens`` (or
``max_completion_tokens``), ``stream`` with ``stream_options.include_usage``, ``seed``, and vLLM's
``ignore_eos`` (generate exactly ``max_tokens``). Without ``ignore_eos`` the output length is drawn from
the emulator's length distribution (seeded by ``seed`` when given) and capped by ``max_tokens``.

Prompt tokens are counted by ``fairgate.api.count_prompt_tokens``: one token per whitespace-separated
word, plus 3 per chat message (the role and template markers). Generated text is `` t1 t2 ...``. A client
that disconnects stops its sequence within one iteration. Bad requests get HTTP 400 with an OpenAI-shaped
error naming the field.

With ``require_tenant_context`` the emulator stands in for an upstream that refuses work without trusted
tenant context (seed 003, "each hop in the backend receives trusted tenant context and rejects when
missing"): a generation request without a non-empty string ``cache_salt`` (vLLM's per-tenant prefix-cache
salt, which the gateway always sets) is answered 400 with ``param`` ``cache_salt``.
"""

from __future__ import annotations

import asyncio
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
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from fairgate.api import ChatRequest, CompletionRequest, GenerationRequest, count_prompt_tokens, error_body
from fairgate.core.cost import CostModel
from fairgate.emulator.replica import EmulatedReplica, Sequence


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

    def cost(self) -> CostModel:
        return CostModel(self.iter_base_ms, self.iter_slope_ms, self.prefill_ms_per_token, self.max_batch)


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
        state.replica = EmulatedReplica(state.settings.cost())
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

    _install_info_routes(app, state)
    return app


def _install_info_routes(app: FastAPI, state: EmulatorState) -> None:
    settings = state.settings

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = {"id": settings.model, "object": "model", "created": 0, "owned_by": "fairgate"}
        return {"object": "list", "data": [{**model, "max_model_len": settings.max_model_len}]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

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
    settings: EmulatorSettings, shared_rng: random.Random, body: GenerationRequest, prompt_tokens: int
) -> tuple[int, str] | JSONResponse:
    """The output length and finish reason of a request (a lognormal draw, capped), or the 400 answer."""
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
    rng = random.Random(body.seed) if body.seed is not None else shared_rng
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
    decided = output_length(state.settings, state.rng, body, prompt_tokens)
    if isinstance(decided, JSONResponse):
        return decided
    length, finish_reason = decided
    replica = state.running()
    seq = replica.submit(prompt_tokens, length, salt)
    reply = _Reply(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()), body.model, chat)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _stream(replica, seq, reply, prompt_tokens, finish_reason, include_usage), media_type="text/event-stream"
        )
    watcher = asyncio.create_task(_cancel_on_disconnect(request, replica, seq))
    try:
        while await seq.events.get() is not None:
            pass
    finally:
        watcher.cancel()
    if seq.cancelled:
        return _error(499, "client closed the request", None, "cancelled")
    text = "".join(f" t{i}" for i in range(1, seq.generated + 1))
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {**reply.head(), "choices": [choice], "usage": _usage(prompt_tokens, seq)}


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


def _usage(prompt_tokens: int, seq: Sequence) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": seq.generated,
        "total_tokens": prompt_tokens + seq.generated,
    }


async def _cancel_on_disconnect(request: Request, replica: EmulatedReplica, seq: Sequence) -> None:
    while not seq.finished and not seq.cancelled:
        if await request.is_disconnected():
            replica.cancel(seq)
            return
        await asyncio.sleep(0.02)


async def _stream(
    replica: EmulatedReplica, seq: Sequence, reply: _Reply, prompt_tokens: int, finish_reason: str, include_usage: bool
) -> AsyncIterator[str]:
    chat = reply.chat

    def chunk(delta_text: str | None, finish: str | None, role: bool = False) -> str:
        if chat:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": ""}
                if role
                else ({"content": delta_text} if delta_text is not None else {})
            )
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}
        body = {**reply.head(chunk=True), "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"

    try:
        if chat:
            yield chunk(None, None, role=True)
        while (index := await seq.events.get()) is not None:
            yield chunk(f" t{index}", None)
        yield chunk(None if chat else "", finish_reason)
        if include_usage:
            body = {**reply.head(chunk=True), "choices": [], "usage": _usage(prompt_tokens, seq)}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        replica.cancel(seq)  # a no-op once finished; stops the sequence if the client went away
