"""Pure scheduling core: cost model, policies, quota arithmetic, fairness metrics. No I/O, no clock."""

from fairgate.core.cost import CostModel
from fairgate.core.fairness import gpu_shares, jain_index, max_min_ratio, weighted
from fairgate.core.policies.factory import POLICY_NAMES, PolicySpec, TenantShare, make_policy
from fairgate.core.policy import Policy
from fairgate.core.ratelimit import TokenBucket
from fairgate.core.request import PRIORITIES, Request, RunningView

__all__ = [
    "POLICY_NAMES",
    "PRIORITIES",
    "CostModel",
    "Policy",
    "PolicySpec",
    "Request",
    "RunningView",
    "TenantShare",
    "TokenBucket",
    "gpu_shares",
    "jain_index",
    "make_policy",
    "max_min_ratio",
    "weighted",
]
