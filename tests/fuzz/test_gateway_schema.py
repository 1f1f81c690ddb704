"""Schemathesis against the gateway's OpenAPI schema, over loopback HTTP, in front of a real emulator with a
16-token context (prompts over the context are common), with a real SQLite ledger.

Every operation gets positive and negative cases with a valid key; no answer may be a 5xx and declared
auth must be enforced. Afterwards no reservation is left open, every balance came back, and the
reservations' billed totals equal the event log (``reconcile``).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import ignored_auth

from fairgate.emulator.api import create_app
from fairgate.gateway.app import create_gateway
from fairgate.gateway.config import GatewaySection, load_gateway_config
from fairgate.harness.config import TenantSpec, gateway_file, quota_file
from fairgate.harness.threads import serve_in_thread
from fairgate.ledger import connect
from fairgate.ledger.config import LimitsConfig, TierConfig
from fairgate.ledger.reconcile import reconcile
from tests.gateway.conftest import REPLICA as GATEWAY_REPLICA

CONTEXT = 16
# The gateway tests' replica, quicker per iteration, with a CONTEXT-token context and short answers.
REPLICA = replace(GATEWAY_REPLICA, iter_base_ms=2.0, iter_slope_ms=0.1, max_model_len=CONTEXT, output_mean_tokens=6.0)
EMULATOR = REPLICA.settings("emu")
TENANT_KEY = f"fg-fuzz-alpha-{'x' * 24}"
ADMIN_KEY = f"fg-fuzz-admin-{'y' * 24}"
# Cases per operation and generation mode: the generation routes get most (they reserve and reach the upstream).
EXAMPLES = {GenerationMode.POSITIVE: 120, GenerationMode.NEGATIVE: 50}
GET_EXAMPLES = 25
# "emu-lying" is served by the same emulator but declares a 64-token context: such prompts pass the gateway's
# check, get a reservation, and are refused by the upstream (400 after admission: the reservation must go).
MODELS = ("emu", "emu-lying")


def _config(tmp: Path, upstream: str) -> Path:
    section = GatewaySection(
        policy="gpu_fair",
        ledger=f"sqlite:///{tmp}/ledger.db",
        journal=f"{tmp}/journal.jsonl",
        default_max_tokens=8,
        max_body_bytes=65536,
        share_charges_s=0,
    )
    upstreams = [
        REPLICA.upstream("emu", upstream, "emu"),
        replace(REPLICA, max_model_len=64).upstream("emu-lying", upstream, "emu-lying"),
    ]
    defaults = LimitsConfig(
        max_queued=16,
        max_concurrent=4,
        max_tokens_per_request=60,
        requests_per_minute=60000,
        requests_burst=1000,
        output_tokens_per_minute=60000,
        max_model_calls=3,
        max_tool_rounds=1,
        max_tokens=100,
    )
    tenants = [TenantSpec("alpha", tier="free"), TenantSpec("beta", tier="free")]
    quotas = quota_file(tenants, {"free": TierConfig()}, defaults)
    path = tmp / "fairgate.toml"
    gateway_file(section, upstreams, quotas, {"alpha": TENANT_KEY}, ADMIN_KEY).write(path)
    return path


def _query(*names: str) -> list[dict[str, Any]]:
    return [{"name": n, "in": "query", "required": False, "schema": {"type": "string"}} for n in names]


def _header(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "header", "required": False, "schema": schema}


# What the routes read from the raw request but do not declare (their decorators live outside app.py).
UNDECLARED_QUERY = {
    "/v1/usage": _query("window", "tenant"),
    "/admin/usage": _query("window"),
    "/admin/reservations": _query("tenant", "status", "limit", "offset"),
    "/admin/reconcile": _query("refresh"),
    "/admin/tenants": [],
    "/admin/frozen": [],
}
GENERATION_HEADERS = [
    _header("X-Request-Id", {"type": "string", "minLength": 1, "maxLength": 8}),  # short: retries collide
    _header("Idempotency-Key", {"type": "string", "minLength": 1, "maxLength": 8}),
    _header("x-fairgate-run-id", {"type": "string", "minLength": 1, "maxLength": 2}),  # run limits are hit
    _header("x-fairgate-tool-round", {"enum": ["0", "1"]}),
]


def _complete(schema: dict[str, Any]) -> dict[str, Any]:
    """The served schema plus the parameters and security the routes read but do not declare."""
    schema = copy.deepcopy(schema)
    schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
    schemes["adminKey"] = {"type": "http", "scheme": "bearer"}
    for path, item in schema["paths"].items():
        for operation in item.values():
            if path in UNDECLARED_QUERY:
                operation["parameters"] = UNDECLARED_QUERY[path]
                operation["security"] = [{"adminKey" if path.startswith("/admin/") else "apiKey": []}]
            elif path in ("/v1/chat/completions", "/v1/completions"):
                operation["parameters"] = GENERATION_HEADERS
    return schema


@st.composite
def _steered(draw: Any, cases: Any) -> Any:
    """Cases whose body names a served model and a small ``max_tokens`` often enough to reach the upstream."""
    case = draw(cases)
    if isinstance(case.body, dict):
        model = draw(st.sampled_from((*MODELS, MODELS[0], None)))
        if model is not None:
            case.body["model"] = model
        cap = draw(st.one_of(st.none(), st.integers(1, 12)))
        if cap is not None and "max_completion_tokens" not in case.body:
            case.body["max_tokens"] = cap
        words = draw(st.one_of(st.none(), st.integers(0, 8), st.integers(CONTEXT - 1, 2 * CONTEXT)))
        if words is not None:
            text = " ".join(["w"] * words)
            if isinstance(case.body.get("messages"), list) and case.body["messages"]:
                case.body["messages"][-1:] = [{"role": "user", "content": text}]
            elif "prompt" in case.body:
                case.body["prompt"] = text
    return case


def _hang_up(
    case: Any, gateway: str, auth: dict[str, str], statuses: Counter[tuple[str, int]], failures: dict[str, str]
) -> None:
    """Send ``case`` and disconnect after 20 ms or the first streamed line, whichever comes first."""
    kwargs = case.as_transport_kwargs(base_url=gateway, headers=auth)
    try:
        with requests.request(**kwargs, stream=True, timeout=(5, 0.02)) as response:
            statuses[(case.operation.label, response.status_code)] += 1
            if response.status_code >= 500:
                failures.setdefault(
                    f"{case.operation.label}: {response.status_code} (hung up)",
                    f"{response.status_code} {response.text[:500]}\n{case.as_curl_command(auth)}",
                )
            next(response.iter_lines(), None)
    except requests.exceptions.RequestException:
        statuses[(case.operation.label, 0)] += 1  # disconnected before the answer


async def _open_reservations(url: str, config: Any) -> list[Any]:
    async with await connect(url, config.quotas) as ledger:
        return await ledger.reservations(status="open")


async def _ledger_problems(url: str, config: Any) -> list[str]:
    """Every broken ledger invariant once nothing runs."""
    problems: list[str] = []
    async with await connect(url, config.quotas) as ledger:
        reservations = await ledger.reservations()
        report = await reconcile(ledger, None, freeze=False)
        problems += [f"{t.tenant}: {d}" for t in report.tenants for d in t.differences]
        for r in reservations:
            if r.billed.output_tokens > r.max_output_tokens:
                problems.append(f"{r.id}: billed {r.billed.output_tokens} output tokens of {r.max_output_tokens}")
        for tenant, model in {(r.tenant, r.model_class) for r in reservations}:
            account = await ledger.account(tenant, model)  # the class's own, else the tenant-wide account
            key = ledger.account_key(tenant, model)
            mine = [r for r in reservations if r.tenant == tenant and key in ("*", r.model_class)]
            billed = sum(r.billed.gpu_ms for r in mine)
            if account.concurrent != 0 or getattr(account, "queued", 0) != 0:
                problems.append(
                    f"{tenant}/{model}: {account.concurrent} concurrency slots and "
                    f"{getattr(account, 'queued', 0)} queue places still held"
                )
            if abs(account.gpu_total_used_ms - billed) > 1e-6 * max(1.0, billed):
                problems.append(f"{tenant}/{model}: GPU ms held {account.gpu_total_used_ms} != billed {billed}")
    return problems


@pytest.mark.slow
def test_schemathesis_finds_no_server_error_and_no_leaked_reservation(tmp_path: Path) -> None:
    started = time.monotonic()
    failures: dict[str, str] = {}  # one report per operation and kind of failure
    statuses: Counter[tuple[str, int]] = Counter()
    with serve_in_thread(create_app(EMULATOR)) as emulator:
        config = load_gateway_config(_config(tmp_path, emulator))
        with serve_in_thread(create_gateway(config)) as gateway, requests.Session() as session:
            admin = {"Authorization": f"Bearer {ADMIN_KEY}"}  # the schema is served to admin keys only
            spec = _complete(httpx.get(f"{gateway}/openapi.json", headers=admin).json())
            schema = schemathesis.openapi.from_dict(spec)
            operations = [result.ok() for result in schema.get_all_operations()]
            assert {"POST /v1/chat/completions", "POST /v1/completions", "GET /admin/reservations"} <= {
                op.label for op in operations
            }
            for operation, mode in itertools.product(operations, GenerationMode):
                declared = spec["paths"][operation.path][operation.method.lower()]
                if mode == GenerationMode.NEGATIVE and not {"parameters", "requestBody", "security"} & set(declared):
                    continue  # nothing to make invalid
                key = ADMIN_KEY if operation.path.startswith("/admin/") else TENANT_KEY
                auth = {"Authorization": f"Bearer {key}"}
                post = operation.method.upper() == "POST"

                # Called at once, within this iteration: the loop variables it reads are this iteration's.
                @settings(
                    max_examples=EXAMPLES[mode] if post else GET_EXAMPLES,
                    deadline=None,
                    database=None,
                    phases=[Phase.generate],
                    suppress_health_check=list(HealthCheck),
                )
                @given(case=_steered(operation.as_strategy(generation_mode=mode)), hang_up=st.integers(0, 4))
                def run(case: Any, hang_up: int) -> None:
                    if post and hang_up == 0:  # noqa: B023
                        _hang_up(case, gateway, auth, statuses, failures)  # noqa: B023
                        return
                    response = case.call(base_url=gateway, session=session, headers=auth, timeout=30)  # noqa: B023
                    statuses[(case.operation.label, response.status_code)] += 1
                    try:
                        case.validate_response(
                            response,
                            checks=[not_a_server_error, ignored_auth],
                            headers=auth,  # noqa: B023
                            transport_kwargs={"base_url": gateway, "session": session, "headers": auth},  # noqa: B023
                        )
                    except FailureGroup as group:
                        for failure in group.exceptions:
                            failures.setdefault(f"{case.operation.label}: {failure.title}", str(group)[:3000])

                run()
            fuzz_s = time.monotonic() - started
            deadline = time.monotonic() + 10  # hung-up requests settle in the background
            while (
                still_open := asyncio.run(_open_reservations(config.ledger_url, config))
            ) and time.monotonic() < deadline:
                time.sleep(0.2)
        problems = asyncio.run(_ledger_problems(config.ledger_url, config))
    print(
        f"\nfuzzed {sum(statuses.values())} requests in {fuzz_s:.1f} s; statuses (0: hung up): "
        f"{dict(sorted(Counter(s for _, s in statuses.elements()).items()))}"
    )
    assert not failures, "\n\n".join(failures.values())
    assert not still_open, f"{len(still_open)} reservations left open: {still_open[:3]}"
    assert not problems, problems
    served = {status for (label, status) in statuses if label.startswith("POST")}
    assert {200, 400, 404, 413} <= served, served  # the fuzz reached the upstream and the context checks
