"""Upstream kinds, credentials and transport, over real HTTP: the real ``openai`` client -> the gateway -> a
fake OpenAI-compatible engine that requires a bearer key and records every body and header it receives.

Per kind: which fields reach the engine, which are refused (400 naming the field, nothing reserved), the
tenant's cache isolation (vLLM and SGLang ``cache_salt``, llama.cpp ``cache_prompt: false``, none elsewhere), the
engine's "prompt too long" answer relayed as ``context_length_exceeded``, and its own OpenAI error refusing a
request relayed as it is; per upstream: the key from an
environment variable or a file, extra headers, a refused key answered 502 and billed nothing, the idle
timeout of a stalled stream, and the configuration errors of a key that cannot be read."""

from __future__ import annotations

import asyncio
import json
import logging
import tomllib
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fairgate.gateway.config import GatewayConfigError, gateway_config_from_dict, load_gateway_config
from fairgate.gateway.kinds import KINDS, OPENAI_CHAT, OPENAI_COMMON, is_context_error, refusal
from fairgate.ledger.base import tenant_tag
from tests.conftest import REPO, fairgate
from tests.gateway import conftest

KEY = "sk-upstream-test-0123456789abcdef"
ENV = "FAIRGATE_TEST_UPSTREAM_KEY"
WORDS = ["one", " two", " three"]
HELLO = [{"role": "user", "content": "hello"}]


@dataclass
class FakeEngine:
    """An OpenAI-compatible engine that requires ``Bearer KEY``, records what it receives, and streams
    ``WORDS`` with usage - or answers ``error`` (status, JSON), or stalls ``stall_s`` before answering."""

    error: tuple[int, Any] | None = None
    stall_s: float = 0.0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)

    def app(self) -> Starlette:
        async def generate(request: Request) -> Response:
            self.headers.append(dict(request.headers))
            self.bodies.append(await request.json())
            given = request.headers.get("authorization", "")
            if given != f"Bearer {KEY}":  # echoes what it refused, as some servers do
                return JSONResponse({"error": {"message": f"invalid api key {given}", "code": 401}}, 401)
            if self.error is not None:
                return JSONResponse(self.error[1], self.error[0])
            if self.stall_s:
                await asyncio.sleep(self.stall_s)
            return StreamingResponse(
                self._events(request.url.path.endswith("/chat/completions")), media_type="text/event-stream"
            )

        return Starlette(
            routes=[Route(f"/v1/{path}", generate, methods=["POST"]) for path in ("chat/completions", "completions")]
        )

    async def _events(self, chat: bool) -> AsyncIterator[str]:
        for word in WORDS:
            choice = {"index": 0, "delta": {"content": word}} if chat else {"index": 0, "text": word}
            yield f"data: {json.dumps({'choices': [choice]})}\n\n"
        yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {}, 'finish_reason': 'stop'}]})}\n\n"
        yield f"data: {json.dumps({'choices': [], 'usage': {'prompt_tokens': 4, 'completion_tokens': 3}})}\n\n"
        yield "data: [DONE]\n\n"


@contextmanager
def gateway(tmp: Path, engine: FakeEngine, **upstream: Any) -> Iterator[tuple[conftest.Stack, openai.OpenAI]]:
    """The gateway in front of ``engine`` (``upstream``: more keys of its ``[[upstream]]``; default the key
    from ``$ENV``), and an OpenAI client of tenant alpha that does not retry."""
    table = {"api_key_env": ENV, **upstream}
    with conftest.serve_stack(tmp, engine.app(), upstream_table=table) as stack:
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.keys["alpha"], max_retries=0, timeout=30)
        yield stack, client


@pytest.fixture(autouse=True)
def upstream_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, KEY)


# What each kind accepts beyond OpenAI's fields (a documented field of the engine's own), and what it gets set.
EXTRAS = {
    "openai": {},
    "vllm": {"min_tokens": 1, "top_k": 5, "ignore_eos": True},
    "sglang": {"min_tokens": 1, "no_stop_trim": True, "ignore_eos": True},
    "llamacpp": {"top_k": 5, "repeat_penalty": 1.1, "ignore_eos": True},
    "tgi": {"tool_prompt": "use the tools"},
}
ISOLATION = {
    "openai": {},
    "vllm": {"cache_salt": tenant_tag("alpha")},
    "sglang": {"cache_salt": tenant_tag("alpha")},
    "llamacpp": {"cache_prompt": False},
    "tgi": {},
}
STREAM_FIELDS: dict[str, dict[str, Any]] = {kind: {} for kind in KINDS} | {"llamacpp": {"timings_per_token": True}}


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_gets_its_fields_its_isolation_and_the_key(tmp_path: Path, kind: str) -> None:
    engine = FakeEngine()
    with gateway(tmp_path, engine, kind=kind, headers={"x-team": "ml"}) as (stack, client):
        extra = {**EXTRAS[kind], "user": "someone", "cache_salt": "forged", "cache_prompt": True, "priority": -9}
        reply = client.chat.completions.create(
            model="emu",
            messages=HELLO,
            max_tokens=3,
            temperature=0.5,
            extra_body=extra,  # type: ignore[arg-type]
        )
        [r] = stack.reservations()
    assert reply.choices[0].message.content == "one two three"
    assert r.status == "settled" and r.billed.output_tokens == 3
    [sent] = engine.bodies
    expected = {**EXTRAS[kind], **ISOLATION[kind], "model": "emu", "messages": HELLO, "max_tokens": 3}
    assert {k: sent[k] for k in expected} == expected
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert not {"user", "priority"} & set(sent)
    vendor = set(sent) - OPENAI_COMMON - OPENAI_CHAT  # nothing the kind does not take
    assert vendor == set(EXTRAS[kind]) | set(ISOLATION[kind]) | set(STREAM_FIELDS[kind]), vendor
    assert {k: sent[k] for k in STREAM_FIELDS[kind]} == STREAM_FIELDS[kind]
    [headers] = engine.headers
    assert headers["authorization"] == f"Bearer {KEY}" and headers["x-team"] == "ml"


@pytest.mark.parametrize(
    ("kind", "name", "value"),
    [
        ("llamacpp", "n_predict", 100_000),  # llama-server reads it before max_tokens
        ("llamacpp", "n_cmpl", 4),
        ("llamacpp", "id_slot", 0),
        ("llamacpp", "n_probs", 5),
        ("llamacpp", "n", 2),  # llama-server answers only one choice
        ("vllm", "use_beam_search", True),
        ("vllm", "n_predict", 5),  # another engine's field
        ("sglang", "lora_path", "x"),
        ("openai", "top_k", 5),  # no vendor field reaches a generic OpenAI server
        ("openai", "ignore_eos", True),
        ("tgi", "ignore_eos", True),
        ("tgi", "service_tier", "priority"),
    ],
)
def test_a_field_the_gateway_cannot_meter_is_refused_before_anything_is_reserved(
    tmp_path: Path, kind: str, name: str, value: Any
) -> None:
    engine = FakeEngine()
    with gateway(tmp_path, engine, kind=kind) as (stack, client):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="emu", messages=HELLO, max_tokens=3, extra_body={name: value})
        assert stack.reservations() == []
    assert refused.value.status_code == 400 and name in refused.value.message
    assert refused.value.body["param"] == name, refused.value.body  # type: ignore[index]
    assert engine.bodies == []


def test_the_key_may_come_from_a_file_beside_the_config(tmp_path: Path) -> None:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "upstream.key").write_text(KEY + "\n")
    engine = FakeEngine()
    with gateway(tmp_path, engine, kind="vllm", api_key_env=None, api_key_file="upstream.key") as (_, client):
        streamed = client.completions.create(model="emu", prompt="hi", max_tokens=3, stream=True)
        assert "".join(chunk.choices[0].text or "" for chunk in streamed if chunk.choices) == "one two three"
    assert [h["authorization"] for h in engine.headers] == [f"Bearer {KEY}"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_key_is_a_502_naming_the_upstream_and_bills_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    wrong = "sk-wrong-key-fedcba9876543210"
    monkeypatch.setenv(ENV, wrong)
    caplog.set_level(logging.WARNING)
    with gateway(tmp_path, FakeEngine(), kind="vllm") as (stack, client):
        with pytest.raises(openai.InternalServerError) as failed:
            client.chat.completions.create(model="emu", messages=HELLO, max_tokens=3, stream=stream)
        [r] = stack.reservations()
    assert failed.value.status_code == 502
    assert "emu-0" in failed.value.message and "credentials" in failed.value.message
    assert r.status == "cancelled" and (r.billed.input_tokens, r.billed.output_tokens, r.billed.gpu_ms) == (0, 0, 0)
    refused = [m for m in caplog.messages if '"auth_refused"' in m]
    assert len(refused) == 1 and "emu-0" in refused[0] and '"upstream_failed"' in refused[0]
    assert not any(wrong in m for m in caplog.messages) and wrong not in json.dumps(failed.value.body)


CONTEXT_ERRORS = {  # what each engine answers a prompt over its context
    "vllm": (
        400,
        {
            "object": "error",
            "message": "This model's maximum context length is 2048 tokens. However, you requested 3000 tokens "
            "(2990 in the messages, 10 in the completion). Please reduce the length of the messages or completion.",
            "type": "BadRequestError",
            "code": 400,
        },
    ),
    "llamacpp": (
        400,
        {
            "error": {
                "code": 400,
                "message": "the request exceeds the available context size, try increasing it",
                "type": "exceed_context_size_error",
            }
        },
    ),
    "sglang": (
        400,
        {
            "object": "error",
            "message": "Requested token count exceeds the model's maximum context length of 2048 tokens.",
        },
    ),
    "tgi": (
        422,
        {
            "error": "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 2048. Given: 2040 "
            "`inputs` tokens and 10 `max_new_tokens`",
            "error_type": "validation",
        },
    ),
}


@pytest.mark.parametrize("kind", list(CONTEXT_ERRORS))
def test_an_engine_refusing_a_prompt_over_its_context_is_context_length_exceeded(tmp_path: Path, kind: str) -> None:
    engine = FakeEngine(error=CONTEXT_ERRORS[kind])
    with gateway(tmp_path, engine, kind=kind) as (stack, client):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="emu", messages=HELLO, max_tokens=3, stream=kind == "llamacpp")
        [r] = stack.reservations()
    assert refused.value.status_code == 400 and refused.value.code == "context_length_exceeded"
    assert refused.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    assert r.status == "cancelled" and (r.billed.input_tokens, r.billed.output_tokens, r.billed.gpu_ms) == (0, 0, 0)


REFUSALS = {  # an engine's own refusal of a request (not of its context) -> what the client gets
    "vllm": (  # vLLM's ErrorResponse: its code is the HTTP status again, a number, no reason to relay
        (
            400,
            {
                "error": {
                    "message": "top_k must be -1 or at least 1",
                    "type": "BadRequestError",
                    "param": "top_k",
                    "code": 400,
                }
            },
        ),
        (400, "top_k must be -1 or at least 1", "BadRequestError", "top_k", None),
    ),
    "openai": (  # a hosted provider
        (
            400,
            {
                "error": {
                    "message": "Invalid value for 'logit_bias'.",
                    "type": "invalid_request_error",
                    "param": "logit_bias",
                    "code": "invalid_value",
                }
            },
        ),
        (400, "Invalid value for 'logit_bias'.", "invalid_request_error", "logit_bias", "invalid_value"),
    ),
    "sglang": (  # vLLM's older top-level error object, no type
        (422, {"object": "error", "message": "temperature is out of range", "param": "temperature"}),
        (422, "temperature is out of range", "invalid_request_error", "temperature", None),
    ),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", list(REFUSALS))
def test_an_engine_refusing_the_request_with_an_openai_error_is_relayed_and_bills_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str, stream: bool
) -> None:
    """Found by a new user: an engine's own 400 came back as ``server_error`` / ``upstream_error``, ``param``
    null, the field only in the message."""
    answer, (status, message, kind_said, param, code) = REFUSALS[kind]
    caplog.set_level(logging.WARNING, logger="fairgate.gateway")
    with gateway(tmp_path, FakeEngine(error=answer), kind=kind) as (stack, client):
        raw = client.chat.completions.with_raw_response
        with pytest.raises(openai.APIStatusError) as refused:
            raw.create(model="emu", messages=HELLO, max_tokens=3, stream=stream, extra_headers={"x-request-id": "r-1"})
        [r] = stack.reservations()
    assert refused.value.status_code == status and refused.value.response.headers["x-request-id"] == "r-1"
    assert refused.value.body == {"message": message, "type": kind_said, "param": param, "code": code}
    assert r.status == "cancelled" and (r.billed.input_tokens, r.billed.output_tokens, r.billed.gpu_ms) == (0, 0, 0)
    [line] = [json.loads(m) for m in caplog.messages if '"upstream_failed"' in m]
    assert line["problem"] == "request_refused" and message in line["error"], line


@pytest.mark.parametrize(
    ("answer", "status"),
    [
        (
            (422, {"error": "Input validation error: `top_n_tokens` must be > 0", "error_type": "validation"}),
            422,
        ),  # TGI
        ((429, {"error": {"message": "Rate limit reached", "type": "requests", "param": None, "code": "rate"}}), 429),
        ((400, "<html>bad request</html>"), 400),
    ],
)
def test_an_error_that_is_no_openai_refusal_of_the_request_stays_the_gateways(
    tmp_path: Path, answer: tuple[int, Any], status: int
) -> None:
    """TGI's error (a string, no object), an engine's 429 (its load, not the client's request) and a body that
    is no error object keep the gateway's ``upstream_error`` with the status relayed."""
    with gateway(tmp_path, FakeEngine(error=answer), kind="tgi") as (stack, client):
        with pytest.raises(openai.APIStatusError) as failed:
            client.chat.completions.create(model="emu", messages=HELLO, max_tokens=3)
        [r] = stack.reservations()
    assert failed.value.status_code == status and failed.value.code == "upstream_error"
    assert failed.value.body["type"] == "server_error" and failed.value.body["param"] is None  # type: ignore[index]
    assert r.status == "cancelled" and r.billed.gpu_ms == 0


def test_another_400_is_not_taken_for_a_context_error() -> None:
    assert is_context_error(KINDS["vllm"], 400, '{"message": "This model\'s maximum context length is 10 tokens"}')
    assert not is_context_error(KINDS["vllm"], 400, '{"message": "temperature must be positive"}')
    assert not is_context_error(KINDS["llamacpp"], 500, "exceeds the available context size")
    assert not is_context_error(KINDS["llamacpp"], 400, "This model's maximum context length is 10 tokens")


def test_a_model_served_by_several_kinds_takes_only_fields_all_of_them_forward() -> None:
    mixed = [KINDS["vllm"], KINDS["openai"]]
    assert refusal(mixed, {"min_tokens": 2, "model": "m"}, chat=True) is not None
    assert refusal(mixed, {"temperature": 0.1, "user": "u", "ignore_eos": False}, chat=True) is None
    assert refusal([KINDS["vllm"]], {"min_tokens": 2}, chat=True) is None
    assert refusal([KINDS["vllm"]], {"echo": True}, chat=True) == (
        "echo",
        "echo: not accepted for a vllm upstream (not a field the gateway forwards to this engine).",
    )


def test_a_stalled_stream_fails_after_its_idle_timeout_and_bills_nothing(tmp_path: Path) -> None:
    with gateway(tmp_path, FakeEngine(stall_s=3.0), kind="vllm", stream_idle_timeout_s=0.3) as (stack, client):
        with pytest.raises(openai.InternalServerError) as failed:
            client.chat.completions.create(model="emu", messages=HELLO, max_tokens=3)
        [r] = stack.reservations()
    assert failed.value.status_code == 504 and "sent nothing for 0.3 s" in failed.value.message
    assert r.status == "cancelled" and r.billed.output_tokens == 0 and r.billed.gpu_ms == 0


# --- configuration ----------------------------------------------------------------------------------


def _config(tmp: Path, **upstream: Any) -> Path:
    path, _ = conftest.write_config(tmp, ["http://127.0.0.1:9"], upstream_table=upstream)
    return path


@pytest.mark.parametrize(
    ("table", "environ", "files", "message"),
    [
        ({"api_key_env": "FG_NO_SUCH_KEY"}, {}, {}, "upstream[0].api_key_env: $FG_NO_SUCH_KEY is not set"),
        (
            {"api_key_env": "FG_EMPTY_KEY"},
            {"FG_EMPTY_KEY": " \n"},
            {},
            "upstream[0].api_key_env: $FG_EMPTY_KEY is empty",
        ),
        ({"api_key_file": "missing.key"}, {}, {}, "upstream[0].api_key_file: cannot read"),
        ({"api_key_file": "empty.key"}, {}, {"empty.key": "\n"}, "upstream[0].api_key_file: "),
    ],
)
def test_a_key_that_cannot_be_read_is_a_config_error_naming_it_and_the_upstream(
    tmp_path: Path, table: dict[str, Any], environ: dict[str, str], files: dict[str, str], message: str
) -> None:
    tmp_path.mkdir(exist_ok=True)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    config = load_gateway_config(_config(tmp_path, **table))
    with pytest.raises(GatewayConfigError) as error:
        config.upstream_keys(environ)
    assert message in str(error.value) and "'emu-0'" in str(error.value)


def test_the_key_read_from_a_file_loses_its_newline_and_shows_nowhere(tmp_path: Path) -> None:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "k").write_text(KEY + "\n")
    config = load_gateway_config(_config(tmp_path, api_key_file="k"))
    keys = config.upstream_keys({})
    assert keys["emu-0"].get_secret_value() == KEY
    assert KEY not in repr(keys) and KEY not in repr(config) and KEY not in json.dumps(config.model_dump(mode="json"))


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"api_key_env": "A", "api_key_file": "b"}, "not both"),
        ({"api_key_env": "not a name"}, "upstream[0].api_key_env: must be an environment variable name"),
        ({"headers": {"Authorization": "Bearer x"}}, "authorization: set the key with api_key_env or api_key_file"),
        ({"headers": {"Transfer-Encoding": "chunked"}}, "hop-by-hop"),
        ({"headers": {"x-a": "b\r\nx-injected: 1"}}, "line break"),
        ({"kind": "ollama"}, "upstream[0].kind"),
        ({"url": "https://127.0.0.1:8001/v1", "ca_file": "none.pem"}, "upstream[0].ca_file: "),
        ({"ca_file": "ca.pem"}, "upstream[0]: ca_file: a CA bundle is used only with an https:// url"),
        # found by a helper: every stream would fail as stalled; one header in two spellings
        ({"stream_idle_timeout_s": 1e-300}, "upstream[0].stream_idle_timeout_s: Input should be greater than"),
        ({"headers": {"X-A": "1", "x-a": "2"}}, "x-a: the same header as X-A"),
    ],
)
def test_bad_upstream_transport_keys_are_config_errors(tmp_path: Path, table: dict[str, Any], message: str) -> None:
    path = _config(tmp_path)
    data = tomllib.loads(path.read_text())
    data["upstream"][0].update(table)
    with pytest.raises(GatewayConfigError) as error:
        gateway_config_from_dict(data, path)
    assert message in str(error.value) and str(path) in str(error.value)


def test_serve_stops_with_exit_code_2_on_an_unset_key(tmp_path: Path) -> None:
    example = (REPO / "config" / "fairgate.example.toml").read_text()
    path = tmp_path / "fairgate.toml"
    path.write_text(example.replace('kind = "vllm"', 'kind = "vllm"\napi_key_env = "FG_TEST_UNSET_UPSTREAM_KEY"', 1))
    from fairgate.harness.process import free_port

    done = fairgate("serve", "--config", str(path), "--port", str(free_port()))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "upstream[0].api_key_env: $FG_TEST_UNSET_UPSTREAM_KEY is not set" in done.stderr
    assert "'emu-0'" in done.stderr
