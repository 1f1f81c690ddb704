"""Build a policy by its command-line name (``fcfs``, ``gpu_fair``, ...) with its parameters."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fairgate.core.cost import CostModel
from fairgate.core.policies.counters import VTC, CounterPolicy, GPUFair, VTCCalibrated
from fairgate.core.policies.drr import DeficitRoundRobin
from fairgate.core.policies.pools import PriorityPools
from fairgate.core.policies.quota import RequestQuota, SlotCap, TokenQuota
from fairgate.core.policies.simple import FCFS, RoundRobin
from fairgate.core.policy import Policy
from fairgate.core.request import PRIORITIES

POLICY_NAMES: tuple[str, ...] = (
    "fcfs",
    "round_robin",
    "request_quota",
    "token_quota",
    "slot_cap",
    "vtc",
    "vtc_calibrated",
    "drr",
    "gpu_fair",
)


@dataclass(frozen=True)
class TenantShare:
    """What a policy needs to know of a tenant: its share weight and priority pool."""

    weight: float = 1.0
    priority: str = PRIORITIES[0]


@dataclass(frozen=True)
class PolicySpec:
    """A policy name and its parameters (``params[name]`` holds that policy's keyword arguments)."""

    name: str
    params: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


def make_policy(spec: PolicySpec, cost: CostModel, tenants: Mapping[str, TenantShare]) -> Policy:
    """A fresh policy object for ``spec``; wrapped in priority pools when tenants use more than one.

    Raises:
        ValueError: unknown policy name or a bad parameter (the message names it).
    """
    if spec.name not in POLICY_NAMES:
        raise ValueError(f"unknown policy {spec.name!r}; choose one of {', '.join(POLICY_NAMES)}")
    weights = {name: t.weight for name, t in tenants.items()}
    params = dict(spec.params.get(spec.name, {}))

    def build() -> Policy:
        name = spec.name
        if name == "fcfs":
            return FCFS(**params)
        if name == "round_robin":
            return RoundRobin(**params)
        if name == "request_quota":
            return RequestQuota(**params)
        if name == "token_quota":
            return TokenQuota(**params)
        if name == "slot_cap":
            return SlotCap(**params)
        if name == "vtc":
            return VTC(weights=weights, **params)
        if name == "vtc_calibrated":
            return VTCCalibrated(cost, weights=weights, **params)
        if name == "drr":
            return DeficitRoundRobin(weights=weights, **params)
        return GPUFair(weights=weights, cost=cost, **params)

    priorities = {name: t.priority for name, t in tenants.items()}
    if len(set(priorities.values())) > 1:
        return PriorityPools(priorities, build)
    return build()


def reshare(policy: Policy, tenants: Mapping[str, TenantShare]) -> None:
    """Apply ``tenants``' weights to a running ``policy`` made by ``make_policy`` (a configuration reload), and
    route the tenants it does not know yet to their priority pools; what each tenant accrued stays.

    Raises:
        ValueError: a weight <= 0, or a priority only a restart can apply (a known tenant's pool changes, or
            a new tenant's pool is not in use: one pool in use is no ``PriorityPools``), before any change.
    """
    priorities = {name: t.priority for name, t in tenants.items()}
    weights = {name: t.weight for name, t in tenants.items()}
    bad = [name for name, weight in weights.items() if not weight > 0]
    if bad:
        raise ValueError(f"weight of tenant {bad[0]!r} must be > 0, got {weights[bad[0]]}")
    targets: tuple[Policy, ...] = (policy,)
    if isinstance(policy, PriorityPools):
        policy.assign(priorities)
        targets = policy.pools
    elif len(set(priorities.values())) > 1:
        raise ValueError("the tenants now use more than one priority pool: applied by a restart only")
    for target in targets:
        if isinstance(target, (CounterPolicy, DeficitRoundRobin)):
            target.reweight(weights)
