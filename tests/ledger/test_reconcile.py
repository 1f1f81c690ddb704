"""Reconciliation on a real ledger: differences freeze the tenant and alert; balances are never edited."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from fairgate.ledger import SettlementFrozen, Usage, connect, quotas_from_dict
from fairgate.ledger.base import tenant_tag
from fairgate.ledger.reconcile import MeteredError, Totals, read_metered, reconcile
from tests.conftest import fairgate

QUOTAS = {"defaults": {"max_concurrent": 10}, "tenants": {"a": {}, "b": {}}}


async def test_metered_difference_freezes_and_alerts(open_ledger, clock):
    ledger = await open_ledger(QUOTAS, clock)
    ra = await ledger.reserve("a", "1", 100, 50, 10.0)
    await ledger.settle(ra.id, 100, 40, 9.0, final=True)
    rb = await ledger.reserve("b", "1", 100, 50, 10.0)
    await ledger.settle(rb.id, 100, 20, 9.0, final=True)
    open_b = await ledger.reserve("b", "2", 100, 50, 10.0)
    before = (
        REGISTRY.get_sample_value(
            "fairgate_reconciliation_alerts_total", {"tenant_hash": tenant_tag("b"), "kind": "metered"}
        )
        or 0.0
    )
    metered = {"a": Totals(100, 40, 9.0), "b": Totals(100, 35, 9.0)}  # the model service saw 15 more tokens
    report = await reconcile(ledger, metered, threshold=0.01)
    assert not report.clean and report.frozen == ["b"]
    row = {t.tenant: t for t in report.tenants}
    assert row["a"].differences == [] and row["b"].open_reservations == 1
    assert row["b"].differences == ["output_tokens: event log 20 vs metered 35 (over 1.0%)"]
    assert (
        REGISTRY.get_sample_value(
            "fairgate_reconciliation_alerts_total", {"tenant_hash": tenant_tag("b"), "kind": "metered"}
        )
        == before + 1
    )
    assert "b" in await ledger.frozen()
    with pytest.raises(SettlementFrozen):
        await ledger.cancel(open_b.id, Usage(100, 1, 1.0))
    assert (await ledger.get(rb.id)).billed == Usage(100, 20, 9.0)  # nothing edited


async def test_a_billed_tenant_the_export_leaves_out_differs_as_metered_zero_and_says_so(open_ledger, clock):
    ledger = await open_ledger(QUOTAS, clock)
    for tenant in ("a", "b"):
        r = await ledger.reserve(tenant, "1", 100, 50, 10.0)
        await ledger.settle(r.id, 100, 40, 9.0, final=True)
    dry = await reconcile(ledger, {"a": Totals(100, 40, 9.0)}, freeze=False)  # b: not in the export
    row = {t.tenant: t for t in dry.tenants}
    assert row["a"].differences == []
    assert row["b"].differences == [
        f"{name}: event log {b:g} vs metered 0, the tenant not in the export (over 1.0%)"
        for name, b in (("input_tokens", 100), ("output_tokens", 40), ("gpu_ms", 9.0))
    ]
    assert dry.frozen == [] and await ledger.frozen() == {}  # a dry run freezes nobody
    report = await reconcile(ledger, {"a": Totals(100, 40, 9.0)})
    assert report.frozen == ["b"] and list(await ledger.frozen()) == ["b"]


async def test_clean_ledger_reconciles(open_ledger, clock):
    ledger = await open_ledger(QUOTAS, clock)
    r = await ledger.reserve("a", "1", 10, 10, 1.0)
    await ledger.settle(r.id, 10, 5, 1.0)
    await ledger.settle(r.id, 10, 8, 2.0, final=True)
    report = await reconcile(ledger, {"a": Totals(10, 8, 2.0)})
    assert report.clean and report.frozen == [] and await ledger.frozen() == {}


@pytest.mark.parametrize(
    "text, match",
    [
        ("tenant,input_tokens\na,1\n", "expected the header"),
        ("tenant,input_tokens,output_tokens,gpu_ms\na,1,x,1\n", "line 2"),
        ("tenant,input_tokens,output_tokens,gpu_ms\na,1,1,1\na,1,1,1\n", "line 3: tenant 'a' appears twice"),
        ("tenant,input_tokens,output_tokens,gpu_ms\na,-1,1,1\n", "whole numbers"),
        ("tenant,input_tokens,output_tokens,gpu_ms\na,1_0,1,1\n", "whole numbers"),
        ("tenant,input_tokens,output_tokens,gpu_ms\na,1,1,inf\n", "finite"),
        ("tenant,input_tokens,output_tokens,gpu_ms,extra\na,1,1,1,x\n", "expected the header"),
    ],
)
def test_bad_metered_export(tmp_path, text, match):
    path = tmp_path / "m.csv"
    path.write_text(text)
    with pytest.raises(MeteredError, match=match):
        read_metered(path)


async def test_cli_reconcile_exit_codes(tmp_path):
    quotas = tmp_path / "q.toml"
    quotas.write_text("[tenants.a]\n")
    url = f"sqlite:///{tmp_path}/l.db"
    ledger = await connect(url, quotas_from_dict({"tenants": {"a": {}}}))
    r = await ledger.reserve("a", "1", 10, 10, 1.0)
    await ledger.settle(r.id, 10, 4, 1.0, final=True)
    await ledger.close()
    metered = tmp_path / "m.csv"
    metered.write_text("tenant,input_tokens,output_tokens,gpu_ms\na,10,4,1.0\n")
    base = ["ledger", "reconcile", "--ledger", url, "--quotas", str(quotas)]
    assert fairgate(*base, "--metered", str(metered)).returncode == 0
    metered.write_text("tenant,input_tokens,output_tokens,gpu_ms\na,10,40,1.0\n")
    assert fairgate(*base, "--metered", str(metered), "--dry-run").returncode == 1
    bad = fairgate(*base, "--metered", str(tmp_path / "none.csv"))
    assert bad.returncode == 2 and "none.csv" in bad.stderr and "Traceback" not in bad.stderr
