"""What one simulation run produces: per-request records, per-tenant totals, a share timeline."""

from __future__ import annotations

from dataclasses import dataclass, field

from fairgate.sim.workload import Workload

NOT_YET = -1  # a time that has not happened (request never admitted / not finished in the run)


@dataclass
class SimResult:
    """Everything an engine measured. Times are integer ns; charges are float ms.

    Attributes:
        admissions: ``(request_id, replica, time_ns)`` in the order requests were admitted.
        admit_ns / first_token_ns / finish_ns: per request, ``NOT_YET`` if it did not happen.
        generated_tokens: per request, output tokens generated in the run.
        request_gpu_ms: per request, GPU ms charged (prefill + decode shares).
        tenant_gpu_ms / tenant_prefill_ms / tenant_decode_tokens: per tenant index.
        busy_ns: per replica, the sum of its iterations' ``dt``.
        iterations: per replica, iterations run.
        timeline: ``(time_ns, cumulative GPU ms per tenant index)`` samples, for plots.
    """

    workload: Workload
    replicas: int
    admit_ns: list[int]
    first_token_ns: list[int]
    finish_ns: list[int]
    generated_tokens: list[int]
    request_gpu_ms: list[float]
    tenant_gpu_ms: list[float]
    tenant_prefill_ms: list[float]
    tenant_decode_tokens: list[int]
    busy_ns: list[int]
    iterations: list[int]
    admissions: list[tuple[int, int, int]] = field(default_factory=list)
    timeline: list[tuple[int, list[float]]] = field(default_factory=list)

    @classmethod
    def empty(cls, workload: Workload, replicas: int) -> SimResult:
        """Nothing measured yet: every request not admitted, every count 0."""
        n, k = len(workload), len(workload.tenants)
        return cls(
            workload=workload,
            replicas=replicas,
            admit_ns=[NOT_YET] * n,
            first_token_ns=[NOT_YET] * n,
            finish_ns=[NOT_YET] * n,
            generated_tokens=[0] * n,
            request_gpu_ms=[0.0] * n,
            tenant_gpu_ms=[0.0] * k,
            tenant_prefill_ms=[0.0] * k,
            tenant_decode_tokens=[0] * k,
            busy_ns=[0] * replicas,
            iterations=[0] * replicas,
        )

    @property
    def busy_ms(self) -> float:
        """Total busy time of all replicas, ms."""
        return sum(self.busy_ns) / 1e6

    @property
    def charged_ms(self) -> float:
        """Total GPU ms charged to tenants (equals ``busy_ms`` up to float rounding)."""
        return sum(self.tenant_gpu_ms)
