"""Usage by API key inside a tenant (seed 003: project, environment and user are secondary dimensions under
the billable tenant): each request carries the id of the key it came with (its stored hash's first 19
characters, a prefix of what ``fairgate keys list`` shows) in the access log and the request log, and ``fairgate
report`` bills each key of a tenant apart - the keys' figures adding up to the tenant's."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from fairgate.cli_ops import summarise_log
from fairgate.gateway.config import load_gateway_config
from fairgate.gateway.eventlog import read_records
from fairgate.ledger.base import tenant_tag
from tests.conftest import fairgate
from tests.gateway.conftest import serve_stack

ADMIN = f"fg-test-admin-{'k' * 24}"


def complete(url: str, key: str, max_tokens: int) -> None:
    body = {"model": "emu", "prompt": "a b", "max_tokens": max_tokens, "ignore_eos": True}
    reply = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert reply.status_code == 200, reply.text


def test_each_key_of_a_tenant_is_billed_apart_in_the_logs_and_the_report(tmp_path: Path) -> None:
    access = tmp_path / "access.jsonl"
    with serve_stack(tmp_path, admin_key=ADMIN, gateway_table={"access_log": str(access)}) as stack:
        made = fairgate("keys", "add", "alpha", "--config", str(stack.config_path), "--name", "laptop")
        assert made.returncode == 0, made.stderr
        laptop = made.stdout.strip()
        reload = httpx.post(f"{stack.url}/admin/reload", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
        assert reload.status_code == 200, reload.text
        for _ in range(2):
            complete(stack.url, stack.keys["alpha"], 5)
        for _ in range(3):
            complete(stack.url, laptop, 7)
        complete(stack.url, stack.keys["beta"], 4)
        refused = httpx.post(
            f"{stack.url}/v1/completions",
            json={"model": "emu", "prompt": "a b", "max_tokens": 100_000},  # over the model's context: a 400
            headers={"Authorization": f"Bearer {laptop}"},
            timeout=30,
        )
        assert refused.status_code == 400, refused.text
    ids = {key.name: key.hash[:19] for key in load_gateway_config(stack.config_path).keys if key.tenant == "alpha"}
    lines = [json.loads(line) for line in access.read_text().splitlines()]
    alpha = tenant_tag("alpha")
    by_key = [(line["key_id"], line["output_tokens"]) for line in lines if line["tenant_hash"] == alpha]
    assert by_key.pop() == (ids["laptop"], 0)  # a refused request is told by the key it came with
    assert sorted(by_key) == sorted([(ids["harness"], 5)] * 2 + [(ids["laptop"], 7)] * 3)
    records = [r for _, _, r in read_records(stack.config.event_log_path)]
    assert [r["key_id"] for r in records if r["event"] == "rejected"] == [ids["laptop"]]
    run = summarise_log(iter(records))
    harness, own = run.keys[(alpha, ids["harness"])], run.keys[(alpha, ids["laptop"])]
    assert (harness.finished, harness.output_tokens, own.finished, own.output_tokens) == (2, 10, 3, 21)
    assert harness.gpu_ms + own.gpu_ms == pytest.approx(run.tenants[alpha].billed_gpu_ms, rel=1e-12)
    assert run.tenants[alpha].billed_gpu_ms > 0
    assert {tag for tag, _ in run.keys} == {alpha, tenant_tag("beta")}
    out = tmp_path / "report"
    done = fairgate("report", "--log", str(stack.config.event_log_path), "--out", str(out))
    assert done.returncode == 0, done.stderr
    page = (out / "report.html").read_text()
    assert "Usage by key" in page and f"{ids['laptop']}..." in page and f"{ids['harness']}..." in page
    # With the configuration, the report names each key by its label as well.
    named = fairgate("report", "--config", str(stack.config_path), "--out", str(tmp_path / "named"))
    assert named.returncode == 0, named.stderr
    page = (tmp_path / "named" / "report.html").read_text()
    assert f"laptop ({ids['laptop']}...)" in page and f"harness ({ids['harness']}...)" in page, page
