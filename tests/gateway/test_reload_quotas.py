"""Reloading ``[quotas]`` without a restart (``fairgate.gateway.reload``): new limits hold from the reload on,
on every ledger backend, while a stream admitted under the old ones runs to its end and is billed exactly
what its client received; a new tenant gets in with its key and its weight reaches the running fair policy;
what only a restart can apply is refused with the running configuration kept whole."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import tomlkit

from fairgate.core.policies.counters import GPUFair
from fairgate.emulator.api import create_app
from fairgate.gateway.app import create_gateway
from fairgate.gateway.config import load_gateway_config
from fairgate.gateway.state import GatewayState, state_of
from fairgate.harness.threads import serve_in_thread
from fairgate.ledger.base import tenant_tag
from tests.conftest import fairgate
from tests.gateway.conftest import EMULATOR, Stack, write_config

ADMIN = f"fg-test-admin-{'q' * 24}"
BODY = {"model": "emu", "prompt": "a b", "max_tokens": 3, "ignore_eos": True}


@contextmanager
def served(tmp: Path, ledger: str | None = None) -> Iterator[tuple[Stack, GatewayState]]:
    with serve_in_thread(create_app(EMULATOR)) as emulator:
        path, keys = write_config(tmp, [emulator], admin_key=ADMIN, ledger=ledger)
        config = load_gateway_config(path)
        app = create_gateway(config)
        with serve_in_thread(app) as url:
            yield Stack(url, keys, path, config), state_of(app)


def post(stack: Stack, tenant: str, key: str | None = None, **body: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key or stack.keys[tenant]}"}
    return httpx.post(f"{stack.url}/v1/completions", json={**BODY, **body}, headers=headers, timeout=30)


def admin(stack: Stack, method: str, route: str) -> httpx.Response:
    return httpx.request(method, f"{stack.url}{route}", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)


def edit(path: Path, change: Callable[[Any], None], table: str | None = "quotas") -> None:
    """``change`` the ``table`` of the file at ``path`` (None: the whole document), written back."""
    document = tomlkit.parse(path.read_text())
    change(document if table is None else document[table])
    path.write_text(tomlkit.dumps(document))


def drop_gamma(document: Any) -> None:
    """Tenant gamma and its key out of the file."""
    document["quotas"]["tenants"].remove("gamma")
    keys = tomlkit.aot()
    for key in document["key"]:
        if key["tenant"] != "gamma":
            keys.append(key)
    document["key"] = keys


def limit(tenant: str, **limits: Any) -> Callable[[Any], None]:
    def change(quotas: Any) -> None:
        table = quotas["tenants"][tenant]
        table["limits"] = {**table.get("limits", {}), **limits}

    return change


def chat_class(document: Any) -> None:
    """A new model ``chat`` (applied by a restart only) and a model class of beta's charged to it."""
    models = tomlkit.aot()
    models.append(tomlkit.item({"name": "chat", "pools": ["emu"]}))
    document["model"] = models
    document["quotas"]["tenants"]["beta"]["model_class"] = {"chat": {"max_concurrent": 1}}


def priced_alias(document: Any) -> None:
    """A new model ``chat`` over the pool ``emu`` (applied by a restart only), priced, and a spend budget: the
    running gateway still charges class ``emu``, unpriced."""
    chat_class(document)
    del document["quotas"]["tenants"]["beta"]["model_class"]
    document["quotas"]["pricing"] = {"model_class": {"chat": {"output_per_mtok": 1.0}}}
    document["quotas"]["defaults"]["spend_budget"] = 10.0


def test_prices_and_a_spend_budget_apply_on_reload_and_a_stream_in_flight_keeps_its_price(tmp_path: Path) -> None:
    with served(tmp_path) as (stack, _):
        with streaming(stack, "before", 300) as lines:

            def priced(document: Any) -> None:
                document["quotas"]["pricing"] = {
                    "currency": "EUR",
                    "model_class": {"emu": {"output_per_mtok": 10_000.0}},
                }
                document["quotas"]["defaults"]["spend_budget"] = 5.0

            edit(stack.config_path, priced, table=None)
            assert admin(stack, "POST", "/admin/reload").status_code == 200
            after = post(stack, "alpha", max_tokens=50)  # 0.5 EUR at most
        assert after.status_code == 200, after.text
        usage = httpx.get(
            f"{stack.url}/v1/usage", headers={"Authorization": f"Bearer {stack.keys['alpha']}"}, timeout=30
        ).json()
        reservations = {r.request_id: r for r in stack.reservations() if r.tenant == "alpha"}
    before = reservations.pop("before")
    [(_, new)] = reservations.items()
    assert before.billed.output_tokens == streamed_tokens(lines) and before.price.output_micros_per_token == 0.0
    assert new.price.output_micros_per_token == 10_000.0 and new.billed.output_tokens == 50
    assert usage["spend"]["currency"] == "EUR" and usage["spend"]["amount"] == pytest.approx(0.5)
    assert usage["spend"]["period"]["budget"] == 5.0 and usage["spend"]["period"]["used"] == pytest.approx(0.5)


@contextmanager
def streaming(stack: Stack, request_id: str, tokens: int) -> Iterator[list[str]]:
    """A stream of alpha's of ``tokens`` tokens running while the block runs; its ``data:`` lines."""
    lines: list[str] = []
    body = {**BODY, "max_tokens": tokens, "stream": True}
    headers = {"Authorization": f"Bearer {stack.keys['alpha']}", "X-Request-Id": request_id}

    def run() -> None:
        with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, headers=headers, timeout=60) as r:
            lines.extend(line for line in r.iter_lines() if line.startswith("data: "))

    runner = threading.Thread(target=run)
    runner.start()
    time.sleep(0.3)  # running: 300 tokens take ~1.3 s on the emulator
    try:
        yield lines
    finally:
        runner.join(60)


def streamed_tokens(lines: list[str]) -> int:
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    return sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"])


@pytest.mark.parametrize("backend", ["sqlite", "redis", "postgres"])
def test_new_limits_hold_from_the_reload_while_a_stream_admitted_before_runs_to_its_end(
    tmp_path: Path, backend: str, backend_url: Callable[[str], str]
) -> None:
    with served(tmp_path, backend_url(backend)) as (stack, _):
        assert post(stack, "alpha", max_tokens=20).status_code == 200
        with streaming(stack, "across", 300) as lines:
            edit(stack.config_path, limit("alpha", max_tokens_per_request=10))
            answer = admin(stack, "POST", "/admin/reload")
            assert answer.status_code == 200 and "quotas" in answer.json()["applied"], answer.text
            refused = post(stack, "alpha", max_tokens=20)
            assert post(stack, "alpha", max_tokens=5).status_code == 200  # 2 prompt + 5 output tokens
            assert post(stack, "beta", max_tokens=20).status_code == 200  # beta's limits did not change
        tenants = {t["tenant"]: t for t in admin(stack, "GET", "/admin/tenants").json()["data"]}
        assert tenants["alpha"]["limits"]["max_tokens_per_request"] == 10
        assert "max_tokens_per_request" not in tenants["beta"]["limits"]
        edit(stack.config_path, lambda quotas: quotas["tenants"]["alpha"].remove("limits"))
        assert admin(stack, "POST", "/admin/reload").status_code == 200
        assert post(stack, "alpha", max_tokens=20).status_code == 200  # the limit is lifted again
        [across] = [r for r in stack.reservations() if r.request_id == "across"]
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["message"] == "Quota max_tokens_per_request exceeded for this tenant."
    # What the client of the stream in flight received is what the ledger holds for it.
    assert streamed_tokens(lines) == 300 == across.billed.output_tokens and across.status == "settled"


def test_a_new_tenant_gets_in_with_its_key_and_its_weight_reaches_the_running_policy(tmp_path: Path) -> None:
    with served(tmp_path) as (stack, state):

        def add_delta(quotas: Any) -> None:
            quotas["tenants"]["delta"] = {"tier": "free", "weight": 3.0, "limits": {"max_tokens_per_request": 8}}
            quotas["tenants"]["beta"]["weight"] = 2.0

        edit(stack.config_path, add_delta)
        added = fairgate("keys", "add", "delta", "--config", str(stack.config_path))
        assert added.returncode == 0, added.stderr
        key = added.stdout.strip()
        assert post(stack, "delta", key).status_code == 401  # not applied yet
        answer = admin(stack, "POST", "/admin/reload")
        assert answer.status_code == 200 and answer.json()["tenants"] == 4, answer.text
        assert post(stack, "delta", key).status_code == 200
        policy = state.dispatcher.policy("emu")
        assert isinstance(policy, GPUFair)
        assert policy.weights == {"alpha": 1.0, "beta": 2.0, "gamma": 1.0, "delta": 3.0}
        assert post(stack, "delta", key, max_tokens=20).status_code == 429  # its own limit
        usage = httpx.get(f"{stack.url}/v1/usage", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert usage.status_code == 200, usage.text
        # Its rejection is counted: the new tenant is tracked by the views too, not only by the ledger.
        assert (usage.json()["requests"], usage.json()["rejections"]["total"]) == (1, 1), usage.text
        tenants = {t["tenant"]: t["weight"] for t in admin(stack, "GET", "/admin/tenants").json()["data"]}
        assert tenants == {"alpha": 1.0, "beta": 2.0, "gamma": 1.0, "delta": 3.0}
        delta = tenant_tag("delta")
    log = (tmp_path / "fairgate-events.jsonl").read_text()
    [reloaded] = [json.loads(line) for line in log.splitlines() if '"reloaded"' in line]
    assert reloaded["tenants"][delta] == {"weight": 3.0, "priority": "interactive"}
    assert reloaded["tenants"][tenant_tag("beta")]["weight"] == 2.0
    # The new tenant's requests are logged under its hash, its name nowhere.
    assert "delta" not in log and f'"tenant_hash":"{delta}"' in log


def test_what_only_a_restart_applies_is_refused_and_the_running_limits_stay(tmp_path: Path) -> None:
    with served(tmp_path) as (stack, state):
        good = stack.config_path.read_text()
        edit(stack.config_path, limit("alpha", max_tokens_per_request=10))
        assert admin(stack, "POST", "/admin/reload").status_code == 200
        refusals = {
            "tenant 'gamma' is gone from the file": drop_gamma,
            "more than one priority pool: applied by a restart only": lambda doc: doc["quotas"]["tenants"]["beta"].add(
                "priority", "batch"
            ),
            "model_class.chat: no model of the running gateway": chat_class,
            "model_class.emu: a model class table added or removed is applied by a restart only": lambda doc: doc[
                "quotas"
            ]["tenants"]["beta"].add("model_class", {"emu": {"max_concurrent": 1}}),
            "the running gateway charges class 'emu', which has no price": priced_alias,
        }
        applied = stack.config_path.read_text()
        for message, change in refusals.items():
            edit(stack.config_path, change, table=None)
            refused = admin(stack, "POST", "/admin/reload")
            assert refused.status_code == 400 and message in refused.json()["error"]["message"], refused.text
            stack.config_path.write_text(applied)
        assert post(stack, "alpha", max_tokens=20).status_code == 429  # the limit applied before still holds
        assert post(stack, "gamma").status_code == 200
        assert good != applied and state.config.quotas.tenant("beta").priority == "interactive"


def test_the_audit_record_of_a_reload_says_what_changed_before_and_after(tmp_path: Path) -> None:
    """Found by a new user: a reload that changed a tenant's limits was audited with ``before: null`` and
    only counts. The record names each changed place with its value before and after; the counts are ``also``."""
    with served(tmp_path) as (stack, state):
        before_table = tomlkit.parse(stack.config_path.read_text())["quotas"]["tenants"]["beta"].unwrap()
        old_keys = {k.hash for k in stack.config.keys}

        def changed(document: Any) -> None:
            limit("beta", max_concurrent=3)(document["quotas"])
            document["quotas"]["defaults"]["requests_per_minute"] = 77
            document["admin"]["key_hashes"].append("sha256$" + "ab" * 32)

        edit(stack.config_path, changed, table=None)
        assert fairgate("keys", "add", "alpha", "--config", str(stack.config_path), "--name", "ci").returncode == 0
        assert admin(stack, "POST", "/admin/reload").status_code == 200
        assert admin(stack, "POST", "/admin/reload").status_code == 200  # nothing changed since
        after_table = tomlkit.parse(stack.config_path.read_text())["quotas"]["tenants"]["beta"].unwrap()
        [new_key] = [k for k in state.config.keys if k.hash not in old_keys]
    records = [json.loads(line) for line in state.config.audit_log_path.read_text().splitlines()]
    reloads = [r for r in records if r["action"] == "config.reload"]
    assert [r["outcome"] for r in reloads] == ["applied", "applied"]
    first, second = reloads
    assert after_table["limits"]["max_concurrent"] == 3 and before_table != after_table
    assert first["before"] == {
        "quotas.tenants.beta": before_table,
        "quotas.defaults": first["before"]["quotas.defaults"],
        "admin.key_hashes": [],
    }
    assert first["after"]["quotas.tenants.beta"] == after_table
    assert first["after"]["quotas.defaults"]["requests_per_minute"] == 77
    assert first["after"]["quotas.defaults"] == {**first["before"]["quotas.defaults"], "requests_per_minute": 77}
    assert first["after"]["admin.key_hashes"] == ["sha256$" + "ab" * 6]
    [key] = first["after"]["key"]
    assert (key["tenant"], key["name"], key["hash"]) == ("alpha", "ci", new_key.hash[:19])
    assert first["also"]["keys"] == len(state.config.keys) and first["also"]["not_applied"] == []
    assert (second["before"], second["after"]) == ({}, {})
