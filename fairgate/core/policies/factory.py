"""Build a policy by its command-line name (``fcfs``, ``gpu_fair``, ...) with its parameters."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fairgate.core.cost import CostModel
from fairgate.core.policies.counters import VTC, GPUFair, VTCCalibrated
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
