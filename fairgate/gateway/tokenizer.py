"""The engine's own count of a prompt's tokens, to size a request by (``intake.size_up``).

The gateway's estimate (``fairgate.api.estimate_prompt_tokens``: words, or one token per 8 bytes) misses the
chat template and under-counts text a tokenizer splits finely (llama.cpp counted ``"hello" * 1200`` as 4,817
tokens against the estimate's 1,203), so a prompt over the context passed the gateway's check and the
engine refused it after it was reserved. Where the upstream's kind has a tokenizer endpoint
(``Kind.tokenizer``) and its ``[[upstream]]`` has ``tokenize = true`` (the default), the prompt is counted by
the engine, with its chat template, before anything is reserved:

- vLLM: ``POST /tokenize`` with the chat's ``messages`` (and ``tools``; the generation prompt added, as its
  chat endpoint does) or the completion's ``prompt``; the answer's ``count``.
- llama.cpp's ``llama-server``: ``POST /apply-template`` with the chat body (its ``prompt``: the templated
  text), then ``POST /tokenize`` of that text (or of the completion's prompt) with ``add_special: true``, as
  its completion endpoints tokenize it (BOS added); the answer's ``tokens``, counted.

The count asked of the first serving upstream (primary pool first) that can give one, through its own HTTP
session (its key and headers), within its ``tokenize_timeout_s`` for the whole exchange. A prompt whose bytes
alone exceed the context is not sent to be counted (it is refused, 413, whatever the count). No answer in time,
an error status, an answer without a count, a count above what the prompt can be (``prompt_tokens_ceiling``:
one token a byte plus any chat template; a tokenizer on the wrong model must not bill a tenant for it), or
no such upstream (SGLang, TGI and hosted providers: their
tokenizer endpoints, where they have one, do not apply the chat template) leave the estimate. Nothing is
cached: each request is counted on its own, whoever sends it. An upstream's tokenizer starting to fail is
logged once (warning ``tokenizer_unavailable``, naming the upstream and what failed), and coming back once
(``tokenizer_available``).

Sources: llama.cpp ``tools/server/README.md`` (``POST /tokenize``: ``content``, ``add_special``, answer
``tokens``; ``POST /apply-template``: ``messages``, answer ``prompt``); vLLM's ``TokenizeChatRequest`` /
``TokenizeCompletionRequest`` (``vllm/entrypoints/openai/protocol.py``: ``messages``,
``add_generation_prompt`` default true, ``tools``; ``prompt``; answer ``count``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp

from fairgate.api import ChatRequest, CompletionRequest, prompt_tokens_ceiling, prompt_tokens_floor
from fairgate.gateway.config import UpstreamConfig
from fairgate.gateway.state import GatewayState
from fairgate.gateway.upstream import UpstreamClient

log = logging.getLogger("fairgate.gateway")

# A chat body's fields that reach the engine's chat template (vLLM's tokenize request takes these names).
TEMPLATE_FIELDS = ("tools", "add_generation_prompt", "continue_final_message", "add_special_tokens")


class NoCount(Exception):
    """The engine answered, but not with a count (an error status, or no count in the answer)."""


async def engine_prompt_tokens(state: GatewayState, body: ChatRequest | CompletionRequest) -> int | None:
    """The prompt tokens of ``body`` as an engine that serves its model counts them (see module docstring),
    or None when none can say in time (the caller then estimates). Never raises for the engine's failings."""
    client = _counting_upstream(state, body.model)
    if client is None or client.settings is None:
        return None
    if isinstance(body, CompletionRequest) and body.prompt_text() is None:
        return None  # token ids: the estimate counts them exactly
    if prompt_tokens_floor(body) >= _context(state, body.model):
        return None  # too long whatever the engine says: refused (413) without asking it
    settings = client.settings
    try:
        async with asyncio.timeout(settings.tokenize_timeout_s):
            count = await _count(client, settings, body)
        if count > prompt_tokens_ceiling(body):
            raise NoCount(f"answered {count} tokens, more than the prompt's bytes and any chat template make")
    except (aiohttp.ClientError, TimeoutError, NoCount) as exc:
        _noted(client, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        return None
    _noted(client, None)
    return count


def _context(state: GatewayState, model: str) -> int:
    """The smallest context among ``model``'s upstreams (the one ``intake.size_up`` checks against)."""
    return min(u.max_model_len for u in state.config.upstreams_for(model))


def _counting_upstream(state: GatewayState, model: str) -> UpstreamClient | None:
    """The first serving upstream of ``model`` (its primary pool first) whose engine can count a prompt."""
    served = state.config.served.get(model)
    if served is None:
        return None
    serving = sorted(state.config.upstreams_for(model), key=lambda u: served.pools.index(u.pool_name))
    for settings in serving:
        client = state.upstreams.get(settings.name)
        if settings.tokenize and settings.engine.tokenizer and client is not None and client.upstream.serving:
            return client
    return None


async def _count(client: UpstreamClient, settings: UpstreamConfig, body: ChatRequest | CompletionRequest) -> int:
    """Ask the engine (``Kind.tokenizer``). Raises ``NoCount``, ``aiohttp.ClientError``, ``TimeoutError``."""
    timeout_s = settings.tokenize_timeout_s
    sent = body.model_dump(mode="json", exclude_unset=True)
    if settings.engine.tokenizer == "vllm":
        ask: dict[str, Any] = {"model": settings.model}
        if isinstance(body, ChatRequest):
            ask |= {"messages": sent["messages"], "add_generation_prompt": True}
            ask |= {name: sent[name] for name in TEMPLATE_FIELDS if sent.get(name) is not None}
        else:
            ask["prompt"] = body.prompt_text()
        return _whole(_answer(*await client.post_json("/tokenize", ask, timeout_s)).get("count"))
    text = body.prompt_text() if isinstance(body, CompletionRequest) else None
    if isinstance(body, ChatRequest):
        template = {name: sent[name] for name in ("messages", "tools", "tool_choice") if sent.get(name) is not None}
        text = _answer(*await client.post_json("/apply-template", template, timeout_s)).get("prompt")
        if not isinstance(text, str):
            raise NoCount("/apply-template answered no prompt")
    tokens = _answer(*await client.post_json("/tokenize", {"content": text, "add_special": True}, timeout_s))
    if not isinstance(tokens.get("tokens"), list):
        raise NoCount("/tokenize answered no tokens")
    return len(tokens["tokens"])


def _answer(status: int, document: Any) -> dict[str, Any]:
    """A 200 answer's JSON object. Raises ``NoCount``."""
    if status != 200 or not isinstance(document, dict):
        raise NoCount(f"answered {status}" + ("" if isinstance(document, dict) else ", not a JSON object"))
    return document


def _whole(count: object) -> int:
    """``count`` when it is a whole number of tokens. Raises ``NoCount``."""
    if type(count) is not int or count < 0:
        raise NoCount(f"answered a count of {json.dumps(count)[:40]}")
    return count


def _noted(client: UpstreamClient, failure: str | None) -> None:
    """Log the upstream's tokenizer failing (``failure``) or working again, once per change."""
    if (failure is not None) == client.tokenizer_failing:
        return
    client.tokenizer_failing = failure is not None
    line: dict[str, Any] = {"event": "tokenizer_unavailable" if failure else "tokenizer_available"}
    line |= {"upstream": client.upstream.name} | ({"problem": failure} if failure else {})
    (log.warning if failure else log.info)(json.dumps(line))
