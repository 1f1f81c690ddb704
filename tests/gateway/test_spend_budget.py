"""A spend budget through the gateway, with the real openai client: requests are priced at their model class's
price, admitted while their worst case fits the month's budget, refused with a 429 naming ``spend_budget``
once it does not, and what each client received, priced, is what the ledger billed and what ``/v1/usage``
shows as money."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from fairgate.cli_ops import summarise_log, write_report
from fairgate.emulator.api import create_app
from fairgate.gateway.call import SETTLE_EVERY_S
from fairgate.gateway.config import GatewayConfigError, load_gateway_config
from fairgate.gateway.eventlog import read_records
from fairgate.ledger.base import tenant_tag
from fairgate.ledger.config import LimitsConfig, PriceConfig, PricingConfig
from tests.gateway.conftest import serve_stack, write_config
from tests.gateway.test_gpu_budget import SLOW, _two_streams

PRICING = PricingConfig(
    currency="EUR", model_class={"emu": PriceConfig(input_per_mtok=1000.0, output_per_mtok=10_000.0, gpu_per_s=0.1)}
)
MAX_TOKENS = 20  # at most 20 x 0.01 EUR of output a request: the budget admits a handful
BUDGET = 1.0
ADMIN_KEY = "fg-test-admin-" + "y" * 24


def _complete(client: openai.OpenAI, request_id: str) -> openai.types.Completion:
    return client.completions.create(
        model="emu",
        prompt="x",
        max_tokens=MAX_TOKENS,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": request_id},
    )


def test_requests_run_until_the_budget_cannot_hold_a_worst_case_and_money_matches_the_ledger(tmp_path: Path) -> None:
    limits = {"alpha": LimitsConfig(spend_budget=BUDGET)}
    with serve_stack(tmp_path, limits=limits, pricing=PRICING, admin_key=ADMIN_KEY) as stack:
        received, refusal = {}, None
        with openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.keys["alpha"], max_retries=0) as client:
            for i in range(10):
                try:
                    received[f"r{i}"] = _complete(client, f"r{i}").usage
                except openai.RateLimitError as exc:
                    refusal = exc
                    break
        usage = httpx.get(
            f"{stack.url}/v1/usage", headers={"Authorization": f"Bearer {stack.keys['alpha']}"}, timeout=10
        ).json()
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        tenants = httpx.get(f"{stack.url}/admin/tenants", headers=admin, timeout=10).json()
        board = httpx.get(f"{stack.url}/dashboard/data", headers=admin, timeout=10).json()
        reservations = {r.request_id: r for r in stack.reservations()}
    assert refusal is not None and 3 <= len(received) <= 5, received  # ~0.2 EUR each of a 1 EUR budget
    body = refusal.body if isinstance(refusal.body, dict) else {}
    assert "spend_budget" in body.get("message", "") and "EUR is left this period" in body["message"], body
    assert float(refusal.response.headers["retry-after"]) > 0  # the next month
    assert set(reservations) == set(received)  # the refused one reserved nothing
    price = stack.config.quotas.price("emu")
    billed = 0.0
    for request_id, got in received.items():
        r = reservations[request_id]
        assert r.price == price and r.status == "settled"
        assert (r.billed.input_tokens, r.billed.output_tokens) == (got.prompt_tokens, got.completion_tokens)
        billed += price.spend_micros(r.billed.input_tokens, r.billed.output_tokens, r.billed.gpu_ms)
    spend = usage["spend"]
    assert spend["currency"] == "EUR"
    assert spend["amount"] == pytest.approx(billed / 1e6, abs=2e-6)
    period = spend["period"]
    assert period["spend_period"] == "month" and period["budget"] == BUDGET
    assert period["used"] == pytest.approx(billed / 1e6, abs=2e-6) and period["used"] <= BUDGET
    assert period["remaining"] == pytest.approx(BUDGET - period["used"], abs=2e-6)
    assert tenants["pricing"] == {
        "currency": "EUR",
        "model_class": {"emu": {"input_per_mtok": 1000.0, "output_per_mtok": 10_000.0, "gpu_per_s": 0.1}},
    }
    [alpha] = [t for t in tenants["data"] if t["tenant"] == "alpha"]
    assert (alpha["limits"]["spend_budget"], alpha["limits"]["spend_period"]) == (BUDGET, "month")
    assert board["currency"] == "EUR" and board["totals"]["alpha"]["spend"] == pytest.approx(billed / 1e6, abs=2e-6)
    run = summarise_log(r for _, _, r in read_records(stack.config.event_log_path))
    assert run.currency == "EUR"
    assert run.tenants[tenant_tag("alpha")].spend_micros == pytest.approx(billed, abs=1e-2)
    out = tmp_path / "report"
    write_report(run, {}, out, stack.config.event_log_path)
    assert "spend EUR" in (out / "report.html").read_text()


def test_a_spend_budget_with_an_unpriced_class_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(GatewayConfigError, match=r"quotas\.pricing\.model_class: .*class 'emu' has no price"):
        load_gateway_config(write_config(tmp_path, ["http://127.0.0.1:9"], defaults=LimitsConfig(spend_budget=5.0))[0])


def test_a_price_for_a_class_nothing_is_charged_to_is_refused(tmp_path: Path) -> None:
    pricing = PricingConfig(model_class={"emu-typo": PriceConfig(input_per_mtok=1.0)})
    with pytest.raises(GatewayConfigError, match=r"quotas\.pricing\.model_class\.emu-typo: no model is charged"):
        load_gateway_config(write_config(tmp_path, ["http://127.0.0.1:9"], pricing=pricing)[0])


def test_streams_on_a_slow_replica_stop_when_the_spend_budget_is_spent(tmp_path: Path) -> None:
    """Priced by the GPU-second, a request on a replica four times slower than its cost model runs past its
    estimate: only the stop holds the budget (as the GPU budget's, ``test_gpu_budget``)."""
    pricing = PricingConfig(model_class={"emu": PriceConfig(gpu_per_s=1.0)})  # 2 GPU-seconds for 2 USD
    limits = {"alpha": LimitsConfig(spend_budget=2.0)}
    with serve_stack(tmp_path, upstream=create_app(SLOW.settings("emu")), limits=limits, pricing=pricing) as stack:
        outcomes, reservations = _two_streams(stack)
    assert all(code == "spend_budget_exhausted" for _, code in outcomes.values()), outcomes
    spent_micros = sum(r.price.spend_micros(0, 0, r.billed.gpu_ms) for r in reservations.values())
    # The budget, plus at most one settlement interval of the replica's time and the ledger round trips of the
    # checks (200 ms on a loaded 2-core machine).
    assert 2e6 <= spent_micros <= (2.0 + SETTLE_EVERY_S) * 1e6 + 2e5, spent_micros
    for request_id, (received, _) in outcomes.items():
        r = reservations[request_id]
        assert r.status == "settled" and received > 0 and r.billed.output_tokens == received, (r, received)


def test_a_worst_case_above_the_whole_budget_is_told_to_lower_max_tokens(tmp_path: Path) -> None:
    with serve_stack(tmp_path, limits={"alpha": LimitsConfig(spend_budget=BUDGET)}, pricing=PRICING) as stack:
        reply = httpx.post(
            f"{stack.url}/v1/completions",
            json={"model": "emu", "prompt": "x", "max_tokens": 200},  # 2 EUR of output at most, of a 1 EUR budget
            headers={"Authorization": f"Bearer {stack.keys['alpha']}"},
            timeout=30,
        )
        reservations = stack.reservations()
    error = reply.json()["error"]
    assert reply.status_code == 429 and error["code"] == "insufficient_quota", reply.text
    assert "whole budget of a period (1 EUR); lower max_tokens" in error["message"], error
    assert "retry-after" not in reply.headers  # waiting does not help
    assert reservations == []
