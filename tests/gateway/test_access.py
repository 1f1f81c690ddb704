"""Per-tenant model access (``[access]``): a tenant sees and may send only its models; another's adapter is to
it a model that does not exist. Over real HTTP with the real ``openai`` client, two emulated replicas (a base
model and a tenant's adapter), and the ledger checked for what a refused request reserved: nothing."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from fairgate.emulator.api import create_app
from fairgate.gateway.app import create_gateway
from fairgate.gateway.config import GatewayConfigError, load_gateway_config
from fairgate.gateway.dashboard import reachable_pools
from fairgate.harness.threads import serve_in_thread
from tests.gateway.conftest import REPLICA, ledger_call, write_config

ACCESS = """
[access]
default = ["emu"]
[access.tenants.beta]
models = ["emu", "beta-lora"]
"""
ADMIN = f"fg-test-admin-{'a' * 24}"


@contextmanager
def _base_and_adapter(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str], str]]:
    """Two emulated replicas, the base model ``emu`` and beta's adapter ``beta-lora``, and a gateway config over
    them with ``ACCESS``: (the config's path, the tenants' keys, the adapter replica's URL)."""
    with (
        serve_in_thread(create_app(REPLICA.settings("emu"))) as base,
        serve_in_thread(create_app(REPLICA.settings("beta-lora"))) as adapter,
    ):
        path, keys = write_config(tmp_path, [base, adapter], models=["emu", "beta-lora"], admin_key=ADMIN)
        path.write_text(path.read_text() + ACCESS)
        yield path, keys, adapter


def test_each_tenant_sees_and_runs_only_its_models_and_a_refusal_reserves_nothing(tmp_path: Path) -> None:
    with _base_and_adapter(tmp_path) as (path, keys, adapter):
        config = load_gateway_config(path)
        with serve_in_thread(create_gateway(config)) as gateway:
            alpha = openai.OpenAI(base_url=f"{gateway}/v1", api_key=keys["alpha"], max_retries=0)
            beta = openai.OpenAI(base_url=f"{gateway}/v1", api_key=keys["beta"], max_retries=0)
            assert [m.id for m in alpha.models.list().data] == ["emu"]
            assert [m.id for m in beta.models.list().data] == ["beta-lora", "emu"]
            with pytest.raises(openai.NotFoundError) as refused:
                alpha.chat.completions.create(
                    model="beta-lora",
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=3,
                    extra_headers={"X-Request-Id": "not-yours"},
                )
            assert refused.value.code == "model_not_found" and "does not exist" in str(refused.value)
            with pytest.raises(openai.NotFoundError):
                alpha.models.retrieve("beta-lora")
            assert beta.models.retrieve("beta-lora").id == "beta-lora"
            reply = beta.chat.completions.create(
                model="beta-lora",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=3,
                extra_body={"ignore_eos": True},
                extra_headers={"X-Request-Id": "mine"},
            )
            assert reply.usage is not None and reply.usage.completion_tokens == 3
            ok = alpha.chat.completions.create(model="emu", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            assert ok.choices[0].message.content
            # The dashboard names only the pools a tenant may reach (found by an outside tester: beta's
            # adapter pool, and when beta used it, showed in alpha's dashboard).
            assert (reachable_pools(config, "alpha"), reachable_pools(config, "beta")) == (
                {"emu"},
                {"emu", "beta-lora"},
            )
            seen = httpx.get(f"{gateway}/dashboard/data", headers={"Authorization": f"Bearer {keys['alpha']}"})
            assert seen.status_code == 200 and "beta-lora" not in seen.text
        reservations = {r.request_id: r for r in ledger_call(config, lambda ledger: ledger.reservations())}
        adapter_stats = httpx.get(f"{adapter}/emulator/stats").json()
    assert "not-yours" not in reservations  # refused before the ledger: nothing reserved, nothing billed
    assert reservations["mine"].tenant == "beta" and reservations["mine"].billed.output_tokens == 3
    assert adapter_stats["tokens_generated"] == 3  # the adapter ran beta's request only


@pytest.mark.parametrize(
    ("access", "message"),
    [
        ('[access]\ndefault = ["nope"]\n', "access.default[0]: no model 'nope'"),
        ('[access.tenants.beta]\nmodels = ["emu", "typo"]\n', "access.tenants.beta.models[1]: no model 'typo'"),
        ('[access.tenants.nobody]\nmodels = ["emu"]\n', "access.tenants.nobody: unknown tenant 'nobody'"),
        ('[access.tenants.beta]\nmodel = ["emu"]\n', "access.tenants.beta"),
    ],
)
def test_a_bad_access_table_is_one_error_naming_it(tmp_path: Path, access: str, message: str) -> None:
    path, _ = write_config(tmp_path, ["http://127.0.0.1:9"])
    path.write_text(path.read_text() + "\n" + access)
    with pytest.raises(GatewayConfigError) as error:
        load_gateway_config(path)
    assert message in str(error.value) and str(path) in str(error.value) and "\n" not in str(error.value)


def test_a_reload_whose_access_names_a_model_not_running_is_refused(tmp_path: Path) -> None:
    """Found by an outside tester: [access] was checked against the file's models, so renaming an alias in
    the file (applied only by a restart) and naming the new name in [access] locked the tenant out."""
    alias = '\n[[model]]\nname = "chat"\npools = ["emu"]\n\n[access]\ndefault = ["chat"]\n'
    with serve_in_thread(create_app(REPLICA.settings("emu"))) as base:
        path, keys = write_config(tmp_path, [base], admin_key=ADMIN)
        path.write_text(path.read_text() + alias)
        config = load_gateway_config(path)
        with serve_in_thread(create_gateway(config)) as gateway:
            path.write_text(path.read_text().replace('"chat"', '"assistant"'))
            answer = httpx.post(f"{gateway}/admin/reload", headers={"Authorization": f"Bearer {ADMIN}"})
            assert answer.status_code == 400 and "'assistant' is not a model of the running gateway" in answer.text
            ok = httpx.post(
                f"{gateway}/v1/chat/completions",
                json={"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                headers={"Authorization": f"Bearer {keys['beta']}"},
            )
            assert ok.status_code == 200, ok.text  # the running access stays


def test_a_reload_keeps_each_tenants_models_its_own(tmp_path: Path) -> None:
    """After a reload, a tenant without a table of its own still may not send another tenant's adapter."""
    with (
        _base_and_adapter(tmp_path) as (path, keys, _),
        serve_in_thread(create_gateway(load_gateway_config(path))) as gateway,
    ):
        answer = httpx.post(f"{gateway}/admin/reload", headers={"Authorization": f"Bearer {ADMIN}"})
        assert answer.status_code == 200, answer.text
        alpha = openai.OpenAI(base_url=f"{gateway}/v1", api_key=keys["alpha"], max_retries=0)
        assert [m.id for m in alpha.models.list().data] == ["emu"]
        with pytest.raises(openai.NotFoundError):
            alpha.models.retrieve("beta-lora")
