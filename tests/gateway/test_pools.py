"""Model aliases and pools over real HTTP: an alias reaches its primary pool under the engine's own model
name, falls back to the next approved pool when the primary has no upstream up, and charges the same tenant
quota whichever pool serves it; ``/v1/models``; config errors name their key."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import tomlkit

from fairgate.core import CostModel, PolicySpec, Request, TenantShare, make_policy
from fairgate.emulator.api import create_app
from fairgate.gateway.app import create_gateway
from fairgate.gateway.config import GatewayConfigError, load_gateway_config
from fairgate.gateway.dispatch import Dispatcher, Upstream
from fairgate.harness.threads import serve_in_thread
from fairgate.ledger.rules import Account
from tests.gateway.conftest import EMULATOR, Stack, post, write_config

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_TEXT = (REPO / "config" / "fairgate.example.toml").read_text()
CHAT = {"model": "chat", "prompt": "x", "max_tokens": 2, "ignore_eos": True}


class Recording:
    """The emulated replica as an ASGI app, keeping the ``model`` of every request body it receives."""

    def __init__(self) -> None:
        self.app = create_app(EMULATOR)
        self.models: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        body = bytearray()

        async def tap() -> dict[str, Any]:
            message: dict[str, Any] = await receive()
            if message["type"] == "http.request":
                body.extend(message.get("body", b""))
                if not message.get("more_body"):
                    self.models.append(json.loads(bytes(body))["model"])
            return message

        await self.app(scope, tap, send)


@dataclass
class Pools:
    stack: Stack
    primary: Recording
    fallback: Recording
    replicas: ExitStack  # closing it stops the primary's replica


def alias_config(path: Path, engine_models: tuple[str, str] | None = None) -> None:
    """Put the two upstreams of ``path`` in pools ``primary`` / ``fallback`` (serving ``engine_models``, if
    given); alias ``chat`` over both, and ``chat-fb`` over the fallback sharing ``chat``'s quota class;
    alpha's ``chat`` class: 3 requests/min."""
    doc = tomlkit.parse(path.read_text())
    for upstream, model in zip(doc["upstream"], engine_models or (), strict=False):  # type: ignore[arg-type]
        upstream["model"] = model
    doc["upstream"][0]["pool"] = "primary"  # type: ignore[index]
    doc["upstream"][1]["pool"] = "fallback"  # type: ignore[index]
    models = tomlkit.aot()
    models.append(tomlkit.item({"name": "chat", "pools": ["primary", "fallback"]}))
    models.append(tomlkit.item({"name": "chat-fb", "pools": ["fallback"], "quota_class": "chat"}))
    doc["model"] = models
    limits = {"requests_per_minute": 3.0, "requests_burst": 3.0, "gpu_seconds_total": 1000.0}
    doc["quotas"]["tenants"]["alpha"]["model_class"] = {"chat": limits}  # type: ignore[index]
    path.write_text(tomlkit.dumps(doc))


ADMIN_KEY = f"fg-test-admin-{'p' * 24}"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@contextmanager
def serve_pools(tmp: Path, engine_models: tuple[str, str] = ("big-engine", "small-engine")) -> Iterator[Pools]:
    """The two upstreams (primary, fallback) serving ``engine_models``, behind the aliases of ``alias_config``."""
    primary, fallback = Recording(), Recording()
    with ExitStack() as outer, ExitStack() as replicas:
        url0 = replicas.enter_context(serve_in_thread(primary))
        url1 = outer.enter_context(serve_in_thread(fallback))
        path, keys = write_config(tmp, [url0, url1], models=["big-engine", "small-engine"], admin_key=ADMIN_KEY)
        alias_config(path, engine_models)
        config = load_gateway_config(path)
        gateway = outer.enter_context(serve_in_thread(create_gateway(config)))
        yield Pools(Stack(gateway, keys, path, config), primary, fallback, replicas)


@pytest.fixture
def pools(tmp_path: Path) -> Iterator[Pools]:
    with serve_pools(tmp_path) as served:
        yield served


def chat_account(stack: Stack) -> Account:
    return stack.ledger_call(lambda ledger: ledger.account("alpha", "chat"))


def get(stack: Stack, route: str) -> httpx.Response:
    return httpx.get(f"{stack.url}{route}", headers={"Authorization": f"Bearer {stack.keys['beta']}"}, timeout=10)


def test_an_alias_reaches_its_primary_pool_under_the_engines_model_name(pools: Pools) -> None:
    reply = post(pools.stack.url, pools.stack.keys["beta"], CHAT)
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == "chat"  # the client sees the name it asked for
    assert pools.primary.models == ["big-engine"] and pools.fallback.models == []
    streamed = httpx.post(
        f"{pools.stack.url}/v1/completions",
        json={**CHAT, "stream": True},
        headers={"Authorization": f"Bearer {pools.stack.keys['beta']}"},
        timeout=30,
    )
    assert streamed.status_code == 200
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert chunks and {c["model"] for c in chunks} == {"chat"}
    assert pools.primary.models == ["big-engine", "big-engine"]


def test_fallback_when_the_primary_pool_is_down_charges_the_same_quota(pools: Pools) -> None:
    stack = pools.stack
    assert post(stack.url, stack.keys["alpha"], CHAT).status_code == 200
    before = chat_account(stack)
    assert before.requests_level is not None and before.gpu_total_used_ms > 0
    pools.replicas.close()  # the primary pool's only replica goes away
    reply = post(stack.url, stack.keys["alpha"], CHAT)
    assert reply.status_code == 200, reply.text
    assert pools.fallback.models == ["small-engine"]  # the fallback's engine name went upstream
    after = chat_account(stack)
    assert after.requests_level is not None and after.requests_level < before.requests_level - 0.9
    assert after.gpu_total_used_ms > before.gpu_total_used_ms  # the fallback's GPU time: the alias's class
    ready = httpx.get(f"{stack.url}/health/ready", headers=ADMIN, timeout=10).json()
    assert ready["status"] == "ready" and ready["upstreams_up"] == {"chat": 1, "chat-fb": 1}


def test_switching_models_does_not_reset_the_quota(pools: Pools) -> None:
    stack, key = pools.stack, pools.stack.keys["alpha"]
    assert [post(stack.url, key, CHAT).status_code for _ in range(3)] == [200, 200, 200]
    assert post(stack.url, key, CHAT).status_code == 429  # alpha's 3 requests/min in class "chat"
    own = post(stack.url, key, {**CHAT, "model": "small-engine"})  # the fallback's engine, by its own name
    assert own.status_code == 404 and own.json()["error"]["code"] == "model_not_found"
    shared = post(stack.url, key, {**CHAT, "model": "chat-fb"})  # another alias in the same quota class
    assert shared.status_code == 429, shared.text
    assert post(stack.url, stack.keys["beta"], CHAT).status_code == 200  # other tenants are unaffected
    assert pools.fallback.models == []


def test_models_lists_the_aliases_and_finds_one(pools: Pools) -> None:
    listed = get(pools.stack, "/v1/models")
    assert listed.status_code == 200
    assert [m["id"] for m in listed.json()["data"]] == ["chat", "chat-fb"]
    one = get(pools.stack, "/v1/models/chat")
    assert one.status_code == 200
    assert one.json() == {"id": "chat", "object": "model", "created": 0, "owned_by": "fairgate"}
    for missing in ("big-engine", "nope", "org/nope"):
        reply = get(pools.stack, f"/v1/models/{missing}")
        assert reply.status_code == 404, missing
        assert reply.json()["error"]["code"] == "model_not_found"
    anonymous = httpx.get(f"{pools.stack.url}/v1/models/chat", timeout=10)
    assert anonymous.status_code == 401


def test_an_engine_model_id_with_a_slash_or_colon_is_sent_as_is_behind_its_alias(tmp_path: Path) -> None:
    """vLLM serves a Hugging Face id by default, Ollama and hosted providers ``name:tag`` / ``org/name``: the
    engine gets its own id, clients and the ledger the alias."""
    hf, tagged = "meta-llama/Llama-3.1-8B-Instruct", "ollama/llama3.1:8b"
    with serve_pools(tmp_path, (hf, tagged)) as pools:
        stack = pools.stack
        reply = post(stack.url, stack.keys["alpha"], CHAT)
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == "chat" and pools.primary.models == [hf]
        assert [m["id"] for m in get(stack, "/v1/models").json()["data"]] == ["chat", "chat-fb"]
        for engine_id in (hf, tagged):  # the engine's id is no model a client may send
            assert get(stack, f"/v1/models/{engine_id}").status_code == 404
            assert post(stack.url, stack.keys["alpha"], {**CHAT, "model": engine_id}).status_code == 404
        assert chat_account(stack).gpu_total_used_ms > 0  # charged in the alias's class
        pools.replicas.close()
        assert post(stack.url, stack.keys["alpha"], CHAT).status_code == 200
        assert pools.fallback.models == [tagged]


@pytest.mark.parametrize("pool", [None, "llama"])
def test_an_engine_model_id_with_a_slash_needs_an_alias(tmp_path: Path, pool: str | None) -> None:
    """Unlisted by a ``[[model]]``, an upstream's model would be a name clients send and a ledger class."""
    text = EXAMPLE_TEXT.replace('model = "fairgate-emulated"', 'model = "meta-llama/Llama-3.1-8B-Instruct"')
    if pool is not None:
        text = text.replace('name = "emu-0"', f'name = "emu-0"\npool = "{pool}"', 1)
    assert config_error(tmp_path, text).startswith(
        'upstream[0].model: "meta-llama/Llama-3.1-8B-Instruct" is the engine\'s name, sent to it as is; clients '
        "and the ledger need a plain name"
    )
    for bad in ("/abs", "has space", ":x", "a\\tb"):  # a TOML escape: a tab
        message = config_error(tmp_path, EXAMPLE_TEXT.replace('model = "fairgate-emulated"', f'model = "{bad}"', 1))
        assert message.startswith("upstream[0].model: "), message


def test_a_waiting_request_moves_to_the_fallback_when_its_pool_goes_down() -> None:
    cost = CostModel(9, 0.55, 0.06, 1)

    async def run() -> None:
        primary, fallback = (
            Upstream("u0", "big", "http://x", 1, cost, pool="p"),
            Upstream("u1", "small", "http://y", 1, cost, pool="f"),
        )
        dispatcher = Dispatcher(
            lambda: make_policy(PolicySpec("gpu_fair", {}), cost, {"a": TenantShare()}),
            [primary, fallback],
            lambda: time.monotonic() * 1000.0,
            lambda tenant: None,
        )
        first = await dispatcher.acquire(Request(1, "a", 10, 0.0), ["p", "f"])
        assert first.upstream is primary
        waiting = asyncio.ensure_future(dispatcher.acquire(Request(2, "a", 10, 1.0), ["p", "f"]))
        await asyncio.sleep(0.01)
        assert not waiting.done()  # the primary is up but full: no fallback for a busy pool
        dispatcher.mark_down(primary)
        second = await asyncio.wait_for(waiting, 1)
        assert second.upstream is fallback and dispatcher.queued("a", "p") == 0

    asyncio.run(run())


def config_error(tmp_path: Path, text: str) -> str:
    path = tmp_path / "fairgate.toml"
    path.write_text(text)
    with pytest.raises(GatewayConfigError) as raised:
        load_gateway_config(path)
    return str(raised.value).removeprefix(f"{path}: ")


def test_the_example_config_is_plain_models(tmp_path: Path) -> None:
    path = tmp_path / "fairgate.toml"
    path.write_text(EXAMPLE_TEXT)
    served = load_gateway_config(path).served
    assert list(served) == ["fairgate-emulated"]
    assert served["fairgate-emulated"].pools == ("fairgate-emulated",) and not served["fairgate-emulated"].alias
    # The alias's class is "chat" now: the example's price moves to it (a price must name a charged class).
    priced = EXAMPLE_TEXT.replace("[quotas.pricing.model_class.fairgate-emulated]", "[quotas.pricing.model_class.chat]")
    aliased = priced + '\n[[model]]\nname = "chat"\npools = ["fairgate-emulated"]\n'
    path.write_text(aliased)
    config = load_gateway_config(path)
    assert list(config.served) == ["chat"]  # the pool is the alias's now: its engine name is no model
    assert config.served["chat"].quota_class == "chat"
    assert [u.name for u in config.upstreams_for("chat")] == ["emu-0", "emu-1"]
    assert config.upstreams_for("fairgate-emulated") == []
    split = EXAMPLE_TEXT.replace('name = "emu-1"', 'name = "emu-1"\npool = "spare"', 1)
    path.write_text(split + '\n[[model]]\nname = "chat"\npools = ["spare"]\nquota_class = "fairgate-emulated"\n')
    served = load_gateway_config(path).served
    assert list(served) == ["chat", "fairgate-emulated"]  # the unlisted pool stays a plain model
    assert served["fairgate-emulated"].pools == ("fairgate-emulated",)
    assert served["chat"].quota_class == "fairgate-emulated"  # one quota class shared by both names


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('[[model]]\nname = "chat"\npools = ["x"]\n', 'model[0].pools[0]: no upstream has pool "x"'),
        (
            '[[model]]\nname = "a"\npools = ["fairgate-emulated"]\n[[model]]\nname = "b"\npools = ["y"]\n',
            'model[1].pools[0]: no upstream has pool "y"',
        ),
        (
            '[[model]]\nname = "a"\npools = ["fairgate-emulated", "fairgate-emulated"]\n',
            'model[0].pools[1]: pool "fairgate-emulated" is listed twice',
        ),
        (2 * '[[model]]\nname = "a"\npools = ["fairgate-emulated"]\n', 'model[1].name: "a" is also model[0]\'s name'),
        ('[[model]]\nname = "a"\npools = []\n', "model[0].pools: "),
        ('[[model]]\nname = "a"\npools = ["fairgate-emulated"]\npool = "x"\n', "model[0].pool: "),
        ('[[model]]\nname = "a"\npools = ["fairgate-emulated"]\nquota_class = "*"\n', "model[0].quota_class: "),
    ],
)
def test_model_table_errors_name_the_key(tmp_path: Path, extra: str, message: str) -> None:
    assert config_error(tmp_path, EXAMPLE_TEXT + "\n" + extra).startswith(message)


def test_pool_errors_name_the_key(tmp_path: Path) -> None:
    second = EXAMPLE_TEXT.replace('name = "emu-1"', 'name = "emu-1"\npool = "shared"', 1)
    second = second.replace('name = "emu-0"', 'name = "emu-0"\npool = "shared"', 1)
    mixed = second.replace('model = "fairgate-emulated"', 'model = "other"', 1)
    assert config_error(tmp_path, mixed).startswith('upstream[1].pool: pool "shared" also holds upstream[0]')
    clash = second + '\n[[model]]\nname = "fairgate-emulated"\npools = ["x"]\n'
    assert config_error(tmp_path, clash).startswith('model[0].name: "fairgate-emulated" is also the model of')
    bad = EXAMPLE_TEXT.replace('name = "emu-0"', 'name = "emu-0"\npool = "no pool"', 1)
    assert config_error(tmp_path, bad).startswith("upstream[0].pool: ")
