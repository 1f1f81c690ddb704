"""What the gateway knows about each kind of upstream engine, as data (``[[upstream]] kind``).

A kind says which request fields reach the engine (an allowlist: OpenAI's chat / completions fields plus
the engine's own sampling fields whose effect the gateway can still meter, because the output stays one
stream of at most ``max_tokens`` tokens); which of the engine's own fields are refused and why (they
bypass ``max_tokens``, generate several sequences, pin a slot, ...); how the gateway isolates tenants in
the engine's prefix cache; whether ``ignore_eos`` is understood; which ``/metrics`` series report its
running and waiting requests and KV-cache use (data for an engine-aware dispatcher: nothing reads them
yet); the wording of its "prompt too long" errors, which the gateway answers as OpenAI's
``context_length_exceeded`` (400) instead of a 502; whether its server counts a prompt's tokens (vLLM's and
llama.cpp's ``/tokenize``: the gateway sizes a request by that count, ``fairgate.gateway.tokenizer``); and
how a stream's tokens are counted (llama.cpp: its per-chunk ``timings.predicted_n``).

The gateway always asks for usage the OpenAI way (``stream_options.include_usage``: the last chunk of the
stream carries ``usage``). vLLM, SGLang and llama.cpp's ``llama-server`` send it; a TGI release whose
Messages API does not accept ``stream_options`` sends none, and then the gateway bills its own counts (the
prompt estimate, the tokens relayed: ``upstream.billable_usage``).

Sources (the engines' own documentation of their OpenAI-compatible servers): vLLM "OpenAI-Compatible
Server", extra parameters and ``SamplingParams``, and its ``cache_salt`` (docs.vllm.ai); SGLang "Sampling
Parameters" and its OpenAI API (docs.sglang.ai; ``cache_salt`` in ``srt/entrypoints/openai/protocol.py``);
llama.cpp ``tools/server/README.md`` (``POST /completion`` options incl. ``timings_per_token``, ``POST
/tokenize`` and ``POST /apply-template``, ``/metrics``, ``/slots``); vLLM's ``/tokenize``
(``TokenizeChatRequest`` / ``TokenizeCompletionRequest`` -> ``count``); TGI "Messages
API" and "Metrics" (huggingface.co/docs/text-generation-inference).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

KindName = Literal["openai", "vllm", "sglang", "llamacpp", "tgi"]
KIND_NAMES: tuple[KindName, ...] = ("openai", "vllm", "sglang", "llamacpp", "tgi")

# OpenAI's own request fields (platform.openai.com/docs/api-reference): what every kind forwards. Left out
# on purpose: ``best_of`` (generates several sequences, bills one), ``modalities`` / ``audio`` (output the
# meter does not count), ``service_tier`` / ``store`` / ``metadata`` (the provider's billing and retention,
# the operator's to choose), ``reasoning_effort`` and ``prediction`` (tokens that never reach the stream).
OPENAI_COMMON = frozenset(
    {
        "model",
        "max_tokens",
        "max_completion_tokens",
        "stream",
        "stream_options",
        "seed",
        "n",
        "temperature",
        "top_p",
        "presence_penalty",
        "frequency_penalty",
        "stop",
        "logit_bias",
        "logprobs",
    }
)
OPENAI_CHAT = frozenset(
    {
        "messages",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "functions",
        "function_call",
    }
)
OPENAI_COMPLETIONS = frozenset({"prompt", "echo", "suffix"})

# Fields that steer an engine's scheduling, identity or caches: the gateway's to set, never a client's. They
# are dropped from what a client sends (not refused: OpenAI clients send ``user`` routinely). vLLM's
# ``priority`` would let a client jump the replica's queue past fair dispatch; ``user`` names a tenant;
# ``cache_salt`` / ``cache_prompt`` are the gateway's tenant isolation; ``request_id`` / ``rid`` would
# collide across tenants; ``timings_per_token`` is how the gateway counts llama.cpp's tokens.
GATEWAY_FIELDS = frozenset(
    {
        "user",
        "priority",
        "request_id",
        "rid",
        "cache_salt",
        "cache_prompt",
        "kv_transfer_params",
        "vllm_xargs",
        "timings_per_token",
    }
)


@dataclass(frozen=True)
class Metrics:
    """Where an engine reports its load: Prometheus series on ``/metrics`` at the server's root (not under
    ``/v1``), and other endpoints; empty: the engine has none the gateway knows."""

    running: str | None = None  # requests in the running batch (gauge)
    waiting: str | None = None  # requests queued for a slot (gauge)
    kv_cache: str | None = None  # KV-cache use, 0-1 (gauge)
    endpoints: tuple[str, ...] = ()  # other load endpoints, relative to the server's root


@dataclass(frozen=True)
class Kind:
    """One engine kind (see module docstring).

    Attributes:
        name: the ``kind`` value.
        fields: the engine's own request fields forwarded beside OpenAI's (both endpoints).
        refused: engine fields a client may know that the gateway cannot meter -> why (the 400's message).
        ignore_eos: the engine understands ``ignore_eos`` (generate exactly ``max_tokens``).
        isolation: fields the gateway sets on every request to keep tenants apart in the engine's prefix
            cache; the value ``TENANT`` stands for the tenant's tag.
        isolation_note: what that isolation gives, in words (documentation).
        usage_note: how its usage is read, in words (documentation).
        metrics: where its load is reported.
        context_errors: lower-case phrases of its "prompt too long" error answers (HTTP 400/413/422).
        choices_max: the most choices (OpenAI's ``n``) one request may ask of it.
        tokenizer: how its server counts a prompt's tokens, chat template included
            (``fairgate.gateway.tokenizer``): ``"vllm"`` (``POST /tokenize``), ``"llamacpp"``
            (``POST /apply-template`` then ``POST /tokenize``); None: it has no such endpoint.
        stream_fields: fields the gateway adds to every streamed request of this kind.
        counts_from_timings: each chunk's ``timings.predicted_n`` (tokens generated so far, llama.cpp's
            ``timings_per_token``) counts its tokens, so a token that decoded to no text and got no chunk of
            its own is still counted.
        prefix_cache: the engine may read part of a prompt from its prefix cache and say so in its usage
            (``prompt_tokens_details.cached_tokens``): a call's prefill charge is final only at its final
            settlement, less the cached share (``fairgate.core.prefix_cache``).
        admits_after_tokens: the engine may take a request that reaches it just after a step's tokens into
            the next step (``LiveMeter.admits_after_burst``): llama-server sends a step's tokens, then reads new
            tasks, then builds its next batch (requests sent up to 15 ms after took part); vLLM's engine core
            takes new requests and starts its next step before its API server process sends the tokens
            (``EngineCore.run_busy_loop``). An engine not known is taken to (a request cut just after is billed
            a part of that step rather than none).
    """

    name: KindName
    fields: frozenset[str] = frozenset()
    refused: Mapping[str, str] = field(default_factory=dict)
    ignore_eos: bool = False
    isolation: Mapping[str, Any] = field(default_factory=dict)
    isolation_note: str = "none the gateway can set"
    usage_note: str = "the stream's last chunk (stream_options.include_usage)"
    choices_max: int = 128
    metrics: Metrics = Metrics()
    context_errors: tuple[str, ...] = ()
    tokenizer: Literal["vllm", "llamacpp"] | None = None
    stream_fields: Mapping[str, Any] = field(default_factory=dict)
    counts_from_timings: bool = False
    prefix_cache: bool = True
    admits_after_tokens: bool = True

    def forwards(self, name: str, chat: bool) -> bool:
        """Whether a client's field ``name`` reaches this engine on the chat (or completions) endpoint."""
        openai = OPENAI_CHAT if chat else OPENAI_COMPLETIONS
        return (
            name in OPENAI_COMMON or name in openai or name in self.fields or (name == "ignore_eos" and self.ignore_eos)
        )


TENANT = object()  # placeholder in ``Kind.isolation``: the tenant's tag (``fairgate.ledger.base.tenant_tag``)

# The wording OpenAI-compatible servers use for a prompt over the context (OpenAI's own error code, and the
# message vLLM and servers copying it send).
_OPENAI_CONTEXT = ("context_length_exceeded", "maximum context length", "is longer than the model's context length")
_MANY_SEQUENCES = "generates several sequences per request; the gateway meters one"

KINDS: Mapping[str, Kind] = {
    "openai": Kind("openai", context_errors=_OPENAI_CONTEXT),
    "vllm": Kind(
        "vllm",
        fields=frozenset(
            {
                "top_k",
                "min_p",
                "repetition_penalty",
                "min_tokens",  # at most max_tokens: still one metered stream
                "stop_token_ids",
                "include_stop_str_in_output",
                "skip_special_tokens",
                "spaces_between_special_tokens",
                "allowed_token_ids",
                "bad_words",
                "truncate_prompt_tokens",
                "add_generation_prompt",
                "continue_final_message",
                "add_special_tokens",
                "structured_outputs",
                "guided_json",
                "guided_regex",
                "guided_choice",
                "guided_grammar",
            }
        ),
        refused={
            "use_beam_search": _MANY_SEQUENCES,
            "best_of": _MANY_SEQUENCES,
            "prompt_logprobs": "scores the whole prompt again; not metered",
            "chat_template": "runs a client-supplied template on the server",
            "chat_template_kwargs": "may turn on reasoning tokens that never reach the stream the gateway meters",
            "logits_processors": "runs client-named code on the server",
        },
        ignore_eos=True,
        isolation={"cache_salt": TENANT},
        isolation_note="cache_salt = the tenant's tag: no prefix-cache hit across tenants",
        metrics=Metrics("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"),
        context_errors=_OPENAI_CONTEXT,
        tokenizer="vllm",
        admits_after_tokens=False,
    ),
    "sglang": Kind(
        "sglang",
        fields=frozenset(
            {
                "top_k",
                "min_p",
                "min_tokens",
                "repetition_penalty",
                "stop_token_ids",
                "no_stop_trim",
                "skip_special_tokens",
                "continue_final_message",
                "regex",
                "ebnf",
                "json_schema",
            }
        ),
        refused={
            "lora_path": "selects an adapter the operator did not configure",
            "return_hidden_states": "returns hidden states the gateway does not meter",
            "custom_logit_processor": "runs client-supplied code on the server",
            "session_params": "keeps server-side sessions across requests and tenants",
            "chat_template_kwargs": "may turn on reasoning tokens that never reach the stream the gateway meters",
        },
        ignore_eos=True,
        # SGLang's OpenAI protocol takes a per-request ``cache_salt`` (sglang PR 10317) that namespaces its
        # radix cache; it reaches the scheduler only in releases with PR 23300 (April 2026; 0.5.18 has it).
        isolation={"cache_salt": TENANT},
        isolation_note="cache_salt = the tenant's tag: no radix-cache hit across tenants",
        metrics=Metrics("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"),
        # SGLang: "Requested token count exceeds the model's maximum context length of N tokens".
        context_errors=(*_OPENAI_CONTEXT, "exceeds the model's maximum context length"),
    ),
    "llamacpp": Kind(
        "llamacpp",
        # llama-server's OpenAI endpoints answer "Only one completion choice is allowed" for any other n.
        choices_max=1,
        fields=frozenset(
            {
                "top_k",
                "min_p",
                "typical_p",
                "repeat_penalty",
                "repeat_last_n",
                "dry_multiplier",
                "dry_base",
                "dry_allowed_length",
                "dry_penalty_last_n",
                "dry_sequence_breakers",
                "xtc_probability",
                "xtc_threshold",
                "mirostat",
                "mirostat_tau",
                "mirostat_eta",
                "dynatemp_range",
                "dynatemp_exponent",
                "top_n_sigma",
                "grammar",
                "json_schema",
                "samplers",
            }
        ),
        refused={
            "n_predict": "llama-server reads it before max_tokens, so it bypasses the output cap; use max_tokens",
            "n_cmpl": _MANY_SEQUENCES,
            "id_slot": "pins the request to a server slot; the gateway's dispatcher places requests",
            "n_probs": "per-token probabilities the gateway does not meter; use logprobs",
            "n_keep": "context shifting generates past the context the gateway sized the request for",
            "n_discard": "context shifting generates past the context the gateway sized the request for",
            "n_indent": "changes when generation stops outside max_tokens",
            "t_max_predict_ms": "a time limit the gateway does not account",
            "lora": "selects an adapter the operator did not configure",
            "post_sampling_probs": "per-token probabilities the gateway does not meter",
            "response_fields": "reshapes the response the gateway reads usage from",
        },
        ignore_eos=True,
        # llama-server has no per-request cache salt: reusing a slot's cached prefix would share it across
        # tenants, so prompt caching is off for every request (each prompt is prefilled in full).
        isolation={"cache_prompt": False},
        isolation_note="cache_prompt = false: no prefix reuse at all, across tenants or within one",
        metrics=Metrics("llamacpp:requests_processing", "llamacpp:requests_deferred", None, ("/slots",)),
        # llama-server: "the request exceeds the available context size, try increasing it"
        # (error type exceed_context_size_error).
        context_errors=("exceeds the available context size", "exceed_context_size_error"),
        tokenizer="llamacpp",
        # A token whose text is empty (half a UTF-8 character, a held-back stop-string prefix) gets no chunk
        # from llama-server; the running count in each chunk's timings still counts it.
        stream_fields={"timings_per_token": True},
        counts_from_timings=True,
        prefix_cache=False,  # cache_prompt = false (above)
    ),
    "tgi": Kind(
        "tgi",
        fields=frozenset({"tool_prompt", "repetition_penalty"}),
        usage_note="the stream's last chunk where the release supports stream_options, else the gateway's counts",
        metrics=Metrics("tgi_batch_current_size", "tgi_queue_size"),
        # TGI validation errors (HTTP 422): "`inputs` tokens + `max_new_tokens` must be <= N" and
        # "`inputs` must have less than N tokens".
        context_errors=(*_OPENAI_CONTEXT, "`inputs` tokens + `max_new_tokens` must be", "`inputs` must have less than"),
    ),
}


def refusal(kinds: list[Kind], body: Mapping[str, Any], chat: bool) -> tuple[str, str] | None:
    """The first field of ``body`` (as the client sent it, nulls left out) that an upstream of one of
    ``kinds`` would not receive, and why; None when every field passes. A request may be dispatched to any
    upstream of its model, so a field must pass every kind. Gateway fields (``GATEWAY_FIELDS``) are
    dropped, not refused; ``ignore_eos: false`` is dropped where it is not understood."""
    for kind in kinds:
        n = body.get("n")
        if isinstance(n, int) and n > kind.choices_max:
            return "n", f"n: a {kind.name} upstream gives {kind.choices_max} choice(s) a request at the most."
    for name, value in body.items():
        if value is None or name in GATEWAY_FIELDS or (name == "ignore_eos" and value is False):
            continue
        for kind in kinds:
            if kind.forwards(name, chat):
                continue
            why = kind.refused.get(name) or "not a field the gateway forwards to this engine"
            return name, f"{name}: not accepted for a {kind.name} upstream ({why})."
    return None


def upstream_body(kind: Kind, body: Mapping[str, Any], chat: bool, tenant_tag: str) -> dict[str, Any]:
    """What the gateway sends ``kind``: the fields of ``body`` it forwards, and its tenant isolation."""
    out = {name: value for name, value in body.items() if kind.forwards(name, chat) and name not in GATEWAY_FIELDS}
    for name, value in kind.isolation.items():
        out[name] = tenant_tag if value is TENANT else value
    return out


def is_context_error(kind: Kind, status: int, detail: str) -> bool:
    """Whether an upstream's error answer (``status``, body text) says the prompt does not fit its context."""
    if status not in (400, 413, 422):
        return False
    text = detail.lower()
    return any(phrase.lower() in text for phrase in kind.context_errors)


__all__ = [
    "GATEWAY_FIELDS",
    "KINDS",
    "KIND_NAMES",
    "TENANT",
    "Kind",
    "KindName",
    "Metrics",
    "is_context_error",
    "refusal",
    "upstream_body",
]
