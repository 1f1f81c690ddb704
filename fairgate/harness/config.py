"""The tenants of a stack and the gateway configuration built for them (with
``fairgate.gateway.config_writer``): a ``TenantSpec`` per tenant, a deterministic API key each, and
``gateway_file`` putting the ``[gateway]`` section, the upstreams, the quota document and the keys together."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from fairgate.core.policies.params import PolicyConfig
from fairgate.gateway.config import DelegationConfig, GatewaySection, UpstreamConfig
from fairgate.gateway.config_writer import GatewayFile, admin_keys, key_entries
from fairgate.ledger.config import LimitsConfig, PricingConfig, QuotaFile, TenantConfig, TierConfig

ADMIN_KEY = f"fg-harness-admin-{'a' * 32}"
UNBOUNDED = LimitsConfig(max_concurrent=100_000, max_queued=100_000)  # scheduling, not a quota, decides


@dataclass(frozen=True)
class TenantSpec:
    """A tenant of the quota document: its tier, share weight, priority pool and limits (over the
    document's ``defaults``)."""

    name: str
    weight: float = 1.0
    tier: str = "drill"
    priority: Literal["interactive", "batch", "eval"] = "interactive"
    limits: LimitsConfig = field(default_factory=LimitsConfig)

    def config(self) -> TenantConfig:
        """Its ``[quotas.tenants.<name>]`` table (what differs from the table's defaults)."""
        given: dict[str, Any] = {
            "tier": self.tier,
            "weight": float(self.weight),
            "priority": self.priority,
            "limits": self.limits,
        }
        return TenantConfig(**{k: v for k, v in given.items() if v != TenantConfig.model_fields[k].default})


def tenant_key(tenant: str) -> str:
    """The API key of ``tenant`` in every harness stack (deterministic: several gateways hash the same key)."""
    return f"fg-harness-{tenant}-{'k' * 32}"


def quota_file(
    tenants: Sequence[TenantSpec],
    tiers: Mapping[str, TierConfig] | None = None,
    defaults: LimitsConfig = UNBOUNDED,
    pricing: PricingConfig | None = None,
) -> QuotaFile:
    """The quota document: ``tiers`` (default one ``drill`` tier that rejects while the ledger is down),
    ``defaults`` (default: no bound on concurrency or queueing), the tenants and the ``pricing`` (none)."""
    return QuotaFile(
        tiers=dict(tiers or {"drill": TierConfig()}),
        defaults=defaults,
        tenants={t.name: t.config() for t in tenants},
        pricing=pricing or PricingConfig(),
    )


def gateway_file(
    section: GatewaySection,
    upstreams: Sequence[UpstreamConfig],
    quotas: QuotaFile,
    keys: Mapping[str, str],
    admin_key: str | None = None,
    delegates: Sequence[str] = (),
    secret_env: str | None = None,
    policy: PolicyConfig | None = None,
) -> GatewayFile:
    """A gateway file with a ``[[key]]`` per tenant -> plain API key, ``[admin]`` with ``admin_key`` (if
    given), and ``[delegation]`` when ``delegates`` or ``secret_env`` are given."""
    delegation = None
    if delegates or secret_env:
        delegation = DelegationConfig(delegates=list(delegates), **({"secret_env": secret_env} if secret_env else {}))
    return GatewayFile(
        section,
        tuple(upstreams),
        quotas,
        key_entries(keys, name="harness"),
        admin_keys(admin_key) if admin_key else None,
        delegation,
        policy,
    )


__all__ = ["ADMIN_KEY", "UNBOUNDED", "TenantSpec", "gateway_file", "quota_file", "tenant_key"]
