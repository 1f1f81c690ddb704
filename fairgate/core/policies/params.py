"""The ``[policy]`` table of scenarios and gateway configs: each policy's parameters, validated.

Every key is checked (unknown keys, wrong types and out-of-range values are errors); the defaults are the
shipped parameters of each policy (``fairgate.core.policies.factory.make_policy`` takes them as keyword
arguments).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    # strict: "24" or true where a number belongs is an error, not a conversion; floats must be finite.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


def _range(low: float, high: float) -> object:
    return Field(ge=low, le=high)


class RequestQuotaParams(_Strict):
    requests_per_minute: Annotated[float, _range(1e-3, 1e9)]
    burst_requests: Annotated[float, _range(1.0, 1e9)] = 1.0


class TokenQuotaParams(_Strict):
    tokens_per_minute: Annotated[float, _range(1e-3, 1e12)]
    burst_tokens: Annotated[float, _range(1.0, 1e12)] | None = None


class SlotCapParams(_Strict):
    max_running: Annotated[int, Field(ge=1, le=100_000_000)]


class VTCParams(_Strict):
    input_weight: Annotated[float, _range(0.0, 1e6)] = 1.0
    output_weight: Annotated[float, _range(0.0, 1e6)] = 2.0


class DRRParams(_Strict):
    quantum_ms: Annotated[float, _range(0.01, 1e6)] = 50.0


class _Empty(_Strict):
    pass


class PolicyConfig(_Strict):
    fcfs: _Empty = _Empty()
    round_robin: _Empty = _Empty()
    request_quota: RequestQuotaParams = RequestQuotaParams(requests_per_minute=100)
    token_quota: TokenQuotaParams = TokenQuotaParams(tokens_per_minute=60_000)
    slot_cap: SlotCapParams | None = None  # default: max_batch * replicas / tenants
    vtc: VTCParams = VTCParams()
    vtc_calibrated: _Empty = _Empty()
    drr: DRRParams = DRRParams()
    gpu_fair: _Empty = _Empty()
