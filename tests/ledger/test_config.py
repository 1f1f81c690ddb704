"""The quota configuration: the example loads; every malformed file is one clear error naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from fairgate.ledger import QuotaConfigError, load_quotas, quotas_from_dict

REPO = Path(__file__).resolve().parents[2]


def test_example_loads_with_overrides_per_tenant_and_model_class():
    quotas = load_quotas(REPO / "config" / "quotas.example.toml")
    acme = quotas.tenant("acme")
    assert (acme.tier.name, acme.weight, acme.limits.max_concurrent, acme.limits.gpu_seconds) == ("paid", 2.0, 32, 7200)
    assert acme.for_model_class("large").max_concurrent == 8
    assert acme.for_model_class("large").gpu_seconds == 7200  # inherited from the tenant
    assert acme.for_model_class("small").max_concurrent == 32
    assert quotas.tenant("sandbox").limits.requests_per_minute == 60
    assert quotas.tenant("sandbox").limits.max_tool_rounds == 20  # from [defaults]
    assert acme.tier.emergency_requests == 20 and quotas.tenant("sandbox").tier.on_ledger_unavailable == "reject"
    assert acme.limits.burst("output_tokens") == 32000 and quotas.tenant("sandbox").limits.burst("requests") == 5


@pytest.mark.parametrize(
    "data, message",
    [
        (
            {"defaults": {"requests_per_minute": -5}},
            "defaults.requests_per_minute: Input should be greater than or equal to 0.000000001",
        ),
        # Bounds that keep the ledger's arithmetic in normal doubles (PostgreSQL's float8 raises beyond them).
        ({"defaults": {"requests_per_minute": 1e-320}}, "defaults.requests_per_minute: Input should be greater"),
        (
            {"defaults": {"gpu_seconds": 1e306}},
            "defaults.gpu_seconds: Input should be less than or equal to 1000000000000000",
        ),
        ({"defaults": {"max_tokens_per_request": 10**13}}, "defaults.max_tokens_per_request: Input should be less"),
        ({"pricing": {"model_class": {"m": {"gpu_per_s": 1e-320}}}}, "a price is 0 or at least 1e-9, got 1e-320"),
        ({"defaults": {"max_concurent": 3}}, "defaults.max_concurent: unknown key"),
        ({"defaults": {"max_concurrent": "many"}}, "defaults.max_concurrent"),
        ({"defaults": {"requests_burst": 0.5, "requests_per_minute": 10}}, "defaults.requests_burst"),
        (
            {"defaults": {"output_tokens_per_minute": 1000, "output_tokens_burst": 500, "max_tokens_per_request": 800}},
            "defaults.output_tokens_burst: 500 is below max_tokens_per_request (800)",
        ),
        ({"tenants": {"a": {"tier": "gold"}}}, "unknown tier 'gold'"),
        ({"tenants": {"b\u202ex": {}}}, "the name contains a control character"),  # right-to-left override
        ({"tenants": {"b\u0085x": {}}}, "the name contains a control character"),  # C1 (NEL)
        ({"tenants": {"a": {"weight": 0}}}, "tenants.a.weight"),
        ({"tenants": {"a": {"limits": {"gpu_seconds": -1}}}}, "tenants.a.limits.gpu_seconds"),
        ({"tenants": {"a": {"model_class": {"big": {"colour": 1}}}}}, "tenants.a.model_class.big.colour: unknown key"),
        (
            {"tenants": {"a": {"model_class": {"*": {"max_concurrent": 1}}}}},
            "tenants.a.model_class.*: '*' cannot name a model class: it is the key of the tenant-wide account",
        ),
        ({"tiers": {"paid": {"on_ledger_unavailable": "emergency"}}}, "needs an emergency"),
        ({"tiers": {"paid": {"on_ledger_unavailable": "fail_open"}}}, "tiers.paid.on_ledger_unavailable"),
    ],
)
def test_bad_config_names_the_key(data, message):
    with pytest.raises(QuotaConfigError, match=r"^q\.toml: ") as excinfo:
        quotas_from_dict(data, "q.toml")
    assert message in str(excinfo.value)


def test_bad_files(tmp_path):
    with pytest.raises(QuotaConfigError, match="file not found"):
        load_quotas(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[defaults\n")
    with pytest.raises(QuotaConfigError, match=f"{broken}: not valid TOML"):
        load_quotas(broken)
