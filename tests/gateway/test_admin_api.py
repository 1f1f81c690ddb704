"""The admin API's writes (``fairgate.gateway.admin_api``) over real HTTP: keys made, rotated and revoked and
tenants created and changed take effect at once, are in the file (a restart keeps them), and are audited;
what the gateway would refuse leaves the file byte for byte as it was. A stream in flight across a change
is billed what its client received."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from fairgate.gateway.audit import read as read_audit
from fairgate.gateway.config import load_gateway_config
from fairgate.gateway.state import GatewayState
from tests.conftest import fairgate
from tests.gateway.conftest import Stack
from tests.gateway.test_reload_quotas import ADMIN, served, streamed_tokens, streaming

AUTH = {"Authorization": f"Bearer {ADMIN}"}


def call(stack: Stack, method: str, route: str, body: Any = None, key: str = ADMIN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.request(method, f"{stack.url}{route}", json=body, headers=headers, timeout=30)


def complete(stack: Stack, key: str, max_tokens: int = 3) -> httpx.Response:
    body = {"model": "emu", "prompt": "a b", "max_tokens": max_tokens, "ignore_eos": True}
    return httpx.post(f"{stack.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def audit_of(stack: Stack) -> list[dict[str, Any]]:
    return read_audit(load_gateway_config(stack.config_path).audit_log_path)


@contextmanager
def admin_stack(tmp: Path) -> Iterator[tuple[Stack, GatewayState]]:
    with served(tmp) as (stack, state):
        yield stack, state


def test_keys_made_rotated_and_revoked_over_http_work_at_once_are_in_the_file_and_audited(tmp_path: Path) -> None:
    with admin_stack(tmp_path) as (stack, _):
        made = call(stack, "POST", "/admin/keys", {"tenant": "beta", "name": "ci", "expires_in_days": 30})
        assert made.status_code == 201, made.text
        first = made.json()["key"]
        assert complete(stack, first).status_code == 200  # no reload: in force at once
        assert [k.name for k in load_gateway_config(stack.config_path).keys if k.tenant == "beta"] == ["harness", "ci"]
        rotated = call(stack, "POST", "/admin/keys/rotate", {"name": "ci", "grace_hours": 0})
        assert rotated.status_code == 200, rotated.text
        second = rotated.json()["key"]
        assert rotated.json()["replaces"] == {
            **{k: made.json()[k] for k in ("tenant", "name", "hash")},
            "expires": None,
            "removed": True,  # grace 0: gone now (expires None alone read as "never")
        }
        assert complete(stack, first).status_code == 401 and complete(stack, second).status_code == 200
        listed = call(stack, "GET", "/admin/keys").json()["data"]
        assert [(k["tenant"], k["name"]) for k in listed] == [
            ("alpha", "harness"),
            ("beta", "harness"),
            ("gamma", "harness"),
            ("beta", "ci"),
        ]
        revoked = call(stack, "POST", "/admin/keys/revoke", {"hash": rotated.json()["hash"]})
        assert revoked.status_code == 200 and revoked.json()["revoked"] is True, revoked.text
        assert complete(stack, second).status_code == 401
        text = (tmp_path / "fairgate-audit.jsonl").read_text()
        records = audit_of(stack)
    assert [(r["action"], r["outcome"]) for r in records] == [
        ("key.add", "applied"),
        ("key.rotate", "applied"),
        ("key.revoke", "applied"),
    ]
    assert {r["actor"] for r in records} == {f"admin:{load_gateway_config(stack.config_path).admin.key_hashes[0][:19]}"}
    assert records[0]["after"]["hash"] == made.json()["hash"] and records[0]["after"]["key"] is None
    assert first not in text and second not in text and ADMIN not in text  # hashes only, never a key


def test_a_tenant_put_over_http_applies_at_once_while_a_stream_runs_and_survives_a_restart(tmp_path: Path) -> None:
    with admin_stack(tmp_path) as (stack, _):
        with streaming(stack, "across", 300) as lines:
            changed = call(
                stack, "PUT", "/admin/tenants/alpha", {"tier": "free", "limits": {"max_tokens_per_request": 10}}
            )
            assert changed.status_code == 200, changed.text
            assert changed.json()["before"] == {"tier": "free"}
            assert changed.json()["after"] == {"tier": "free", "limits": {"max_tokens_per_request": 10}}
            assert complete(stack, stack.keys["alpha"], 20).status_code == 429
        created = call(
            stack,
            "PUT",
            "/admin/tenants/delta",
            {"tier": "free", "weight": 2, "priority": "interactive", "model_class": {"emu": {"max_concurrent": 2}}},
        )
        assert created.status_code == 201 and created.json()["created"] is True, created.text
        key = call(stack, "POST", "/admin/keys", {"tenant": "delta"}).json()["key"]
        assert complete(stack, key).status_code == 200
        tenants = {t["tenant"]: t for t in call(stack, "GET", "/admin/tenants").json()["data"]}
        [across] = [r for r in stack.reservations() if r.request_id == "across"]
    assert tenants["delta"]["weight"] == 2.0 and tenants["alpha"]["limits"]["max_tokens_per_request"] == 10
    assert tenants["delta"]["model_class"]["emu"]["max_concurrent"] == 2 and tenants["alpha"]["model_class"] == {}
    assert streamed_tokens(lines) == 300 == across.billed.output_tokens and across.status == "settled"
    restarted = load_gateway_config(stack.config_path)  # what a restart reads
    assert restarted.quotas.tenant("alpha").limits.max_tokens_per_request == 10
    assert restarted.quotas.tenant("delta").weight == 2.0 and [k.tenant for k in restarted.keys][-1] == "delta"
    assert [(r["action"], r["target"], r["outcome"]) for r in audit_of(stack)][:2] == [
        ("tenant.put", {"tenant": "alpha"}, "applied"),
        ("tenant.put", {"tenant": "delta"}, "applied"),
    ]


@pytest.mark.parametrize(
    ("method", "route", "body", "status", "code", "needle"),
    [
        (
            "PUT",
            "/admin/tenants/beta",
            {"tier": "free", "priority": "batch"},
            400,
            "config_invalid",
            "applied by a restart only",
        ),
        (
            "PUT",
            "/admin/tenants/beta",
            {"tier": "free", "limits": {"max_concurrent": "2"}},
            400,
            "invalid_request",
            "limits.max_concurrent",
        ),
        ("PUT", "/admin/tenants/beta", {"limit": {}}, 400, "invalid_request", "limit:"),
        ("PUT", "/admin/tenants/beta", {"tier": "gold"}, 400, "config_invalid", "unknown tier 'gold'"),
        ("PUT", "/admin/tenants/a%01b", {"tier": "free"}, 400, "config_invalid", "quotas.tenants"),
        ("POST", "/admin/keys", {"tenant": "nobody"}, 404, "tenant_not_found", "nobody"),
        ("POST", "/admin/keys", {"tenant": "beta", "expires_in_days": 0}, 400, "invalid_request", "expires_in_days"),
        ("POST", "/admin/keys/revoke", {"name": "nobody"}, 404, "key_not_found", "no [[key]] matches"),
        ("POST", "/admin/keys/revoke", {"name": "harness"}, 400, "invalid_request", "3 keys match"),
        (
            "POST",
            "/admin/keys/revoke",
            {"name": "harness", "hash": "sha256$0123456789ab"},
            400,
            "invalid_request",
            "one of them",
        ),
        ("POST", "/admin/keys/rotate", {"hash": "sha256$01"}, 400, "invalid_request", "first 19+ characters"),
        ("POST", "/admin/keys/rotate", {"hash": "sha256$0123456789abcdef"}, 404, "key_not_found", "no [[key]] matches"),
        ("GET", "/admin/audit?limit=%C2%B2", None, 400, "invalid_request", "limit"),
    ],
)
def test_a_refused_write_leaves_the_file_as_it_was_and_is_audited(
    tmp_path: Path, method: str, route: str, body: Any, status: int, code: str, needle: str
) -> None:
    with admin_stack(tmp_path) as (stack, state):
        before = stack.config_path.read_text()
        answer = call(stack, method, route, body)
        assert answer.status_code == status and answer.json()["error"]["code"] == code, answer.text
        assert needle in answer.json()["error"]["message"], answer.text
        assert stack.config_path.read_text() == before
        assert complete(stack, stack.keys["beta"]).status_code == 200
        assert state.config.quotas.tenant("beta").priority == "interactive"
        records = audit_of(stack)
    # A write the edit or the running gateway refused is audited; a body refused as it is read is no write.
    if code in ("config_invalid", "key_not_found", "tenant_not_found") or needle == "3 keys match":
        assert [r["outcome"] for r in records] == ["refused"] and needle in records[0]["error"]
    else:
        assert records == []


def test_only_an_admin_key_writes(tmp_path: Path) -> None:
    with admin_stack(tmp_path) as (stack, _):
        before = stack.config_path.read_text()
        tenant = call(stack, "POST", "/admin/keys", {"tenant": "alpha"}, key=stack.keys["alpha"])
        anonymous = httpx.put(f"{stack.url}/admin/tenants/alpha", json={}, timeout=10)
        assert (tenant.status_code, anonymous.status_code) == (403, 401)
        assert stack.config_path.read_text() == before and audit_of(stack) == []


def test_writes_over_http_and_fairgate_keys_at_once_lose_nothing(tmp_path: Path) -> None:
    with admin_stack(tmp_path) as (stack, _):

        def over_http(i: int) -> str:
            answer = call(stack, "POST", "/admin/keys", {"tenant": "gamma", "name": f"http-{i}"})
            assert answer.status_code == 201, answer.text
            return str(answer.json()["key"])

        def by_cli(i: int) -> str:
            done = fairgate("keys", "add", "gamma", "--config", str(stack.config_path), "--name", f"cli-{i}")
            assert done.returncode == 0, done.stderr
            return done.stdout.strip()

        with ThreadPoolExecutor(6) as pool:
            made = [pool.submit(over_http, i) for i in range(4)] + [pool.submit(by_cli, i) for i in range(2)]
            keys = [f.result() for f in made]
        assert call(stack, "POST", "/admin/reload").status_code == 200  # the CLI's keys need a reload
        assert [complete(stack, key).status_code for key in keys] == [200] * 6
        names = sorted(k.name or "" for k in load_gateway_config(stack.config_path).keys if k.tenant == "gamma")
        actions = [(r["action"], r["outcome"]) for r in audit_of(stack)]
    assert names == ["cli-0", "cli-1", "harness", "http-0", "http-1", "http-2", "http-3"]
    assert sorted(actions) == sorted(
        [("key.add", "applied")] * 4 + [("key.add", "written")] * 2 + [("config.reload", "applied")]
    )


def test_a_key_pasted_where_its_hash_or_name_belongs_is_refused_and_never_written(tmp_path: Path) -> None:
    with admin_stack(tmp_path) as (stack, _):
        leaked = stack.keys["alpha"]
        for body in ({"hash": leaked}, {"name": leaked}, {"hash": ADMIN}):
            refused = call(stack, "POST", "/admin/keys/revoke", body)
            assert refused.status_code == 400 and "that is an API key" in refused.text, refused.text
            assert leaked not in refused.text
        # A new key's label holding a key, alone or among words, would be written in clear: refused too.
        for label in (leaked, f"Bearer {leaked}", f"my key is '{leaked}',", f" {leaked}\n"):
            made = call(stack, "POST", "/admin/keys", {"tenant": "alpha", "name": label})
            assert made.status_code == 400 and "holds an API key" in made.text, made.text
            assert leaked not in made.text
        # A name with a line separator of Unicode's: the audit log stays one record a line for every reader.
        odd = call(stack, "POST", "/admin/keys/revoke", {"name": "\u2028x\u0085"})
        assert odd.status_code == 404, odd.text
        records = call(stack, "GET", "/admin/audit").json()["data"]
        assert complete(stack, leaked).status_code == 200  # and the key was not revoked
        text = (tmp_path / "fairgate-audit.jsonl").read_text()
    assert [r["target"]["name"] for r in records] == ["\u2028x\u0085"]
    assert leaked not in text and ADMIN not in text


def test_writes_and_reloads_at_once_leave_the_gateway_running_what_the_file_says(tmp_path: Path) -> None:
    with admin_stack(tmp_path) as (stack, state):

        def put(weight: int) -> int:
            body = {"tier": "free", "weight": weight}
            return call(stack, "PUT", "/admin/tenants/gamma", body).status_code

        def reload(_: int) -> int:
            return call(stack, "POST", "/admin/reload").status_code

        with ThreadPoolExecutor(3) as pool:
            for weight in range(1, 13):
                statuses = list(pool.map(lambda job: job[0](job[1]), [(put, weight), (reload, 0), (reload, 0)]))
                assert statuses == [200, 200, 200], statuses
                running = state.config.quotas.tenant("gamma").weight
                assert running == load_gateway_config(stack.config_path).quotas.tenant("gamma").weight == weight


def test_a_write_that_cannot_be_recorded_or_put_in_place_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with admin_stack(tmp_path) as (stack, state):
        before = stack.config_path.read_text()
        audit_log = tmp_path / "fairgate-audit.jsonl"
        audit_log.mkdir()  # not a file: nothing can be recorded
        refused = call(stack, "PUT", "/admin/tenants/beta", {"tier": "free", "weight": 42})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "audit_log_unavailable"
        assert state.config.quotas.tenant("beta").weight == 1.0 and stack.config_path.read_text() == before
        audit_log.rmdir()

        def cannot_rename(self: Any) -> None:  # the rename over the file fails (a full or read-only disk)
            self.discard()
            raise PermissionError("injected: rename refused")

        monkeypatch.setattr("fairgate.keyfile.Staged.commit", cannot_rename)
        for method, route, body in [
            ("PUT", "/admin/tenants/beta", {"tier": "free", "weight": 42}),
            ("PUT", "/admin/tenants/newt", {"tier": "free"}),
            ("POST", "/admin/keys/revoke", {"name": "harness", "hash": None}),
        ]:
            body = {k: v for k, v in body.items() if v is not None}
            answer = call(stack, method, route, body)
            assert answer.status_code in (400, 503), answer.text
        assert state.config.quotas.tenant("beta").weight == 1.0 and "newt" not in state.config.quotas.tenants
        assert stack.config_path.read_text() == before
        monkeypatch.undo()
        # Nothing was left half applied: a reload and a write go through.
        assert call(stack, "POST", "/admin/reload").status_code == 200
        assert call(stack, "PUT", "/admin/tenants/newt", {"tier": "free"}).status_code == 201
        assert complete(stack, stack.keys["beta"]).status_code == 200


def test_the_audit_record_names_hand_edits_a_write_brought_into_force(tmp_path: Path) -> None:
    with admin_stack(tmp_path) as (stack, _):
        text = stack.config_path.read_text()
        stack.config_path.write_text(
            text.replace('[quotas.tenants.gamma]\ntier = "free"', '[quotas.tenants.gamma]\ntier = "free"\nweight = 7.0')
        )
        put = call(stack, "PUT", "/admin/tenants/beta", {"tier": "free", "weight": 2.5})
        assert put.status_code == 200, put.text
        [record] = audit_of(stack)
    assert record["before"] == {"tier": "free"} and record["after"] == {"tier": "free", "weight": 2.5}
    assert record["also"] == {"tenants": ["gamma"], "keys_added": 0, "keys_removed": 0}


def test_a_key_for_a_tenant_added_by_hand_is_made_and_the_tenant_applied_with_it(tmp_path: Path) -> None:
    with admin_stack(tmp_path) as (stack, state):
        with stack.config_path.open("a") as file:
            file.write('\n[quotas.tenants.delta]\ntier = "free"\n')
        made = call(stack, "POST", "/admin/keys", {"tenant": "delta"})
        assert made.status_code == 201, made.text
        assert complete(stack, made.json()["key"]).status_code == 200 and "delta" in state.config.quotas.tenants
        [record] = audit_of(stack)
    assert record["also"] == {"tenants": ["delta"], "keys_added": 0, "keys_removed": 0}
