"""A table of limits overrides the ones under it key by key, bursts included: a tenant (or a model class)
may set only the burst of a bucket whose rate comes from ``[defaults]``; a burst no rate applies to is still
refused, naming the key."""

from __future__ import annotations

import pytest

from fairgate.ledger import QuotaConfigError, quotas_from_dict
from fairgate.ledger.config import LimitsConfig
from tests.gateway.conftest import post, serve_stack


def test_a_tenant_may_override_the_burst_alone():
    quotas = quotas_from_dict(
        {
            "defaults": {"requests_per_minute": 60, "input_tokens_per_minute": 6000, "input_tokens_burst": 500},
            "tenants": {
                "acme": {"limits": {"requests_burst": 5, "input_tokens_burst": 3000}},
                "other": {"model_class": {"large": {"requests_burst": 2}}},
            },
        },
        "q.toml",
    )
    acme = quotas.tenant("acme").limits
    assert (acme.requests_per_minute, acme.burst("requests")) == (60, 5.0)
    assert (acme.input_tokens_per_minute, acme.burst("input_tokens")) == (6000, 3000.0)
    other = quotas.tenant("other")
    assert (other.limits.burst("requests"), other.limits.burst("input_tokens")) == (60.0, 500.0)
    large = other.for_model_class("large")
    assert (large.requests_per_minute, large.burst("requests")) == (60, 2.0)


@pytest.mark.parametrize(
    "document, key",
    [
        ({"defaults": {"requests_burst": 5}}, "defaults.requests_burst"),
        ({"tenants": {"acme": {"limits": {"output_tokens_burst": 50}}}}, "tenants.acme.limits.output_tokens_burst"),
        (
            {
                "defaults": {"requests_per_minute": 60},
                "tenants": {"acme": {"model_class": {"l": {"input_tokens_burst": 9}}}},
            },
            "tenants.acme.model_class.l.input_tokens_burst",
        ),
    ],
)
def test_a_burst_without_any_rate_is_refused_naming_the_key(document, key):
    dimension = key.rsplit(".", 1)[1].removesuffix("_burst")
    with pytest.raises(QuotaConfigError) as caught:
        quotas_from_dict(document, "q.toml")
    assert str(caught.value) == (
        f"q.toml: {key}: set, but no {dimension}_per_minute applies (neither in this table nor in the ones it "
        "overrides): a burst needs a rate"
    )


def test_over_http_a_tenant_with_its_own_burst_gets_that_many_at_once(tmp_path):
    # One request a minute refills: on a loaded machine three posts may take seconds, and 60/min would refill.
    defaults = LimitsConfig(requests_per_minute=1, requests_burst=3)
    with serve_stack(tmp_path, defaults=defaults, limits={"alpha": LimitsConfig(requests_burst=2)}) as stack:
        codes = [post(stack.url, stack.keys["alpha"]).status_code for _ in range(3)]
        assert codes == [200, 200, 429]
        assert [post(stack.url, stack.keys["beta"]).status_code for _ in range(3)] == [200] * 3
