"""Isolation of shared state (seed 003, "Isolate all shared state"): every hop gets trusted tenant context and
refuses work without it, and nothing shared (prefix cache, idempotency, in-flight runs, key cache) can be hit
across tenants. Over real HTTP: gateway -> recorded emulated replica, with a real SQLite ledger."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from fairgate.core.request import Request as CoreRequest
from fairgate.emulator.api import create_app
from fairgate.gateway.app import create_gateway
from fairgate.gateway.auth import KeyRing, hash_api_key
from fairgate.gateway.config import load_gateway_config
from fairgate.gateway.dispatch import QueueFull
from fairgate.gateway.state import state_of
from fairgate.harness.process import fairgate_process, free_port
from fairgate.harness.threads import serve_in_thread
from fairgate.ledger import InvalidUsage, Ledger, LedgerUnavailable, UnknownTenant, connect, quotas_from_dict
from fairgate.ledger.base import tenant_tag
from fairgate.ledger.emergency import EMERGENCY_PREFIX, ResilientLedger
from tests.gateway import conftest
from tests.gateway.conftest import EMULATOR, post_at_once, write_config

STRICT_EMULATOR = EMULATOR.model_copy(update={"require_tenant_context": True})


class Recorder:
    """ASGI wrapper that keeps the JSON body of every request reaching the wrapped app (the upstream)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.bodies: list[dict[str, Any]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        if raw:
            self.bodies.append(json.loads(raw))
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


@dataclass
class Stack(conftest.Stack):
    upstream: Recorder

    def post(
        self, tenant: str, path: str = "/v1/completions", headers: dict[str, str] | None = None, **body: Any
    ) -> httpx.Response:
        auth = {"Authorization": f"Bearer {self.keys[tenant]}"} if tenant else {}
        return httpx.post(
            f"{self.url}{path}", json={"model": "emu", **body}, headers={**auth, **(headers or {})}, timeout=30
        )


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    upstream = Recorder(create_app(STRICT_EMULATOR))  # refuses any request without a cache_salt
    with conftest.serve_stack(tmp_path, upstream) as served:
        yield Stack(**vars(served), upstream=upstream)


# --- (a) the prefix cache: one salt per tenant, set by the gateway only ------------------------------


def test_the_same_prompt_from_two_tenants_gets_each_tenant_its_own_cache_salt(stack: Stack) -> None:
    prompt = "the very same long shared system prompt " * 5
    for tenant in ("alpha", "beta", "alpha"):
        reply = stack.post(tenant, prompt=prompt, max_tokens=2, ignore_eos=True)
        assert reply.status_code == 200, reply.text
    salts = [body["cache_salt"] for body in stack.upstream.bodies]
    assert salts == [tenant_tag("alpha"), tenant_tag("beta"), tenant_tag("alpha")]
    assert salts[0] != salts[1]  # no prefix-cache hit across tenants; the same tenant still shares its own
    assert all(body["prompt"] == prompt for body in stack.upstream.bodies)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "x y", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x y"}], "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True}),
    ],
)
def test_a_client_cannot_choose_its_cache_salt_or_name_a_tenant_upstream(
    stack: Stack, path: str, body: dict[str, Any]
) -> None:
    forged = {
        "cache_salt": tenant_tag("beta"),
        "user": "beta",
        "priority": -100,
        "request_id": "beta-1",
        "kv_transfer_params": {"x": 1},
        **body,
    }
    reply = stack.post("alpha", path, **forged)
    assert reply.status_code == 200, reply.text
    [sent] = stack.upstream.bodies
    assert sent["cache_salt"] == tenant_tag("alpha")
    assert "user" not in sent and "beta" not in json.dumps(sent)
    # Fields that steer the upstream's own scheduling never pass: vLLM's priority would jump fair dispatch.
    assert not {"priority", "request_id", "kv_transfer_params"} & set(sent)
    assert stack.post("alpha", path, **{**body, "cache_salt": None}).status_code == 200
    assert stack.upstream.bodies[-1]["cache_salt"] == tenant_tag("alpha")


# --- (b) an upstream that refuses requests without tenant context ------------------------------------


def test_the_strict_emulator_refuses_a_request_without_cache_salt() -> None:
    with serve_in_thread(create_app(STRICT_EMULATOR)) as emulator:
        for salt in ({}, {"cache_salt": ""}, {"cache_salt": "  "}, {"cache_salt": 5}, {"cache_salt": None}):
            for path, body in (
                ("/v1/completions", {"prompt": "x"}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
            ):
                reply = httpx.post(
                    f"{emulator}{path}", json={"model": "emu", "max_tokens": 2, **body, **salt}, timeout=10
                )
                assert reply.status_code == 400, (salt, reply.text)
                assert reply.json()["error"]["param"] == "cache_salt"
                assert reply.json()["error"]["code"] == "missing_tenant_context"
        reply = httpx.post(
            f"{emulator}/v1/completions",
            timeout=10,
            json={"model": "emu", "prompt": "x", "max_tokens": 2, "cache_salt": "t"},
        )
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
    with serve_in_thread(create_app(EMULATOR)) as lenient:  # the default stays as before
        assert (
            httpx.post(
                f"{lenient}/v1/completions", json={"model": "emu", "prompt": "x", "max_tokens": 1}, timeout=10
            ).status_code
            == 200
        )


def test_every_gateway_call_passes_tenant_context_to_a_strict_upstream(stack: Stack) -> None:
    assert stack.post("alpha", prompt="a b", max_tokens=3, ignore_eos=True).json()["usage"]["completion_tokens"] == 3
    chat = stack.post("beta", "/v1/chat/completions", messages=[{"role": "user", "content": "a"}], max_tokens=2)
    assert chat.status_code == 200, chat.text
    streamed = stack.post("gamma", prompt="a", max_tokens=2, stream=True, ignore_eos=True)
    assert streamed.status_code == 200 and "upstream_error" not in streamed.text and "[DONE]" in streamed.text
    assert [r.status for r in stack.reservations()] == ["settled"] * 3


def test_the_emulate_command_has_a_require_tenant_context_flag() -> None:
    port = free_port()
    with fairgate_process(["emulate", "--port", str(port), "--model", "emu", "--require-tenant-context"], port) as url:
        refused = httpx.post(f"{url}/v1/completions", json={"model": "emu", "prompt": "x", "max_tokens": 1}, timeout=10)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "cache_salt"
        served = httpx.post(
            f"{url}/v1/completions",
            timeout=10,
            json={"model": "emu", "prompt": "x", "max_tokens": 1, "cache_salt": "abc"},
        )
        assert served.status_code == 200


# --- (c) the ledger and the dispatcher refuse work without a tenant -----------------------------------


@pytest.mark.parametrize("tenant", ["", None, "\x00", "a\nb"])
async def test_the_ledger_refuses_a_reservation_without_a_tenant(tmp_path: Path, tenant: Any) -> None:
    quotas = quotas_from_dict({"tenants": {"alpha": {}}})
    async with await connect(f"sqlite:///{tmp_path}/ledger.db", quotas) as ledger:
        for front in (ledger, ResilientLedger(ledger, tmp_path / "journal.jsonl")):
            with pytest.raises(InvalidUsage, match="tenant"):
                await front.reserve(tenant, "r-1", 1, 1)
        with pytest.raises(UnknownTenant):  # no fallback to a public or default tenant
            await ledger.reserve("public", "r-1", 1, 1)
        assert await ledger.reservations() == [] and await ledger.events() == []


class DownLedger:
    """A ledger that cannot be reached (the emergency path of ``ResilientLedger``)."""

    limits = Ledger.limits

    def __init__(self, quotas: Any) -> None:
        self.quotas = quotas

    async def reserve_args(self, *args: Any, **kwargs: Any) -> Any:
        raise LedgerUnavailable("down")


@pytest.mark.parametrize("tenant", ["", None, "public", "default"])
async def test_an_outage_grants_no_emergency_budget_without_a_known_tenant(tmp_path: Path, tenant: Any) -> None:
    quotas = quotas_from_dict(
        {
            "tiers": {
                "default": {
                    "on_ledger_unavailable": "emergency",
                    "emergency": {"requests": 5, "tokens": 1000, "seconds": 60},
                }
            },
            "tenants": {"alpha": {}},
        }
    )
    front = ResilientLedger(DownLedger(quotas), tmp_path / "journal.jsonl")  # type: ignore[arg-type]
    with pytest.raises(UnknownTenant):
        await front.reserve(tenant, "r-1", 1, 1)
    assert front.outstanding() == 0 and not (tmp_path / "journal.jsonl").exists()
    granted = await front.reserve("alpha", "r-1", 1, 1)  # the path works for a configured tenant
    assert granted.id.startswith(EMERGENCY_PREFIX) and granted.tenant == "alpha"


@pytest.mark.parametrize("tenant", ["", None, "public"])
async def test_the_gateway_dispatcher_refuses_a_request_without_a_known_tenant(tmp_path: Path, tenant: Any) -> None:
    path, _ = write_config(tmp_path, ["http://127.0.0.1:9"])
    dispatcher = state_of(create_gateway(load_gateway_config(path))).dispatcher
    with pytest.raises(QueueFull) as excinfo:
        await dispatcher.acquire(CoreRequest(1, tenant, 1, 0.0, 1), "emu")
    assert excinfo.value.limit == 0 and dispatcher.queued_by_tenant() == {} and dispatcher.running_by_tenant() == {}
    lease = await dispatcher.acquire(CoreRequest(2, "alpha", 1, 0.0, 1), "emu")  # a configured tenant is served
    dispatcher.release(lease)


def test_a_request_without_a_credential_reaches_neither_ledger_nor_upstream(stack: Stack) -> None:
    for headers in ({}, {"Authorization": "Bearer"}, {"Authorization": "Bearer fg-unknown"}):
        reply = stack.post("", headers={**headers, "X-Tenant": "alpha"}, prompt="x", max_tokens=1, user="alpha")
        assert reply.status_code == 401
    assert stack.upstream.bodies == [] and stack.reservations() == []


# --- (d) shared state is keyed by tenant ------------------------------------------------------------


def test_two_tenants_may_use_the_same_request_id(stack: Stack) -> None:
    key = {"Idempotency-Key": "shared-id"}
    both = [(stack.url, stack.keys[t], dict(conftest.BODY, max_tokens=n), key) for t, n in (("alpha", 20), ("beta", 7))]
    replies = post_at_once(both, timeout=30)
    assert [r.status_code for r in replies] == [200, 200]  # in flight at once: no 409 across tenants
    booked = {(r.tenant, r.request_id): (r.status, r.billed.output_tokens) for r in stack.reservations()}
    assert booked == {("alpha", "shared-id"): ("settled", 20), ("beta", "shared-id"): ("settled", 7)}
    # A retry is answered per tenant: each sees its own completed request, nothing is charged again.
    again = stack.post("beta", headers={"Idempotency-Key": "shared-id"}, prompt="x", max_tokens=7, ignore_eos=True)
    assert again.status_code == 409 and again.json()["error"]["code"] == "request_already_completed"
    assert len(stack.reservations()) == 2


def test_the_key_cache_is_keyed_by_the_whole_credential() -> None:
    alpha, beta = "fg-isolation-alpha-key-0000", "fg-isolation-beta-key-00000"
    ring = KeyRing([("alpha", hash_api_key(alpha)), ("beta", hash_api_key(beta))])
    assert ring.tenant_for(alpha) == "alpha"  # now cached
    for near in (alpha[:-1], alpha + "0", alpha.upper(), alpha[:-1] + "1", " " + alpha):
        assert ring.tenant_for(near) is None
    assert ring.tenant_for(beta) == "beta" and ring.tenant_for(alpha) == "alpha"
    salted = KeyRing([("alpha", hash_api_key(alpha, bytes(16))), ("beta", hash_api_key(beta, bytes(16)))])
    assert salted.tenant_for(alpha) == "alpha"  # now cached
    assert [salted.tenant_for(near) for near in (alpha[:-1], alpha + "0", " " + alpha)] == [None] * 3
    assert salted.tenant_for(beta) == "beta" and salted.tenant_for(alpha) == "alpha"
