"""Deficit round robin over GPU time, for work whose size is only known as it is spent.

Source: M. Shreedhar, G. Varghese, "Efficient Fair Queuing using Deficit Round Robin", SIGCOMM 1995,
adapted as seed 003 suggests ("weighted fair scheduling or deficit round robin"): a packet's size is
known when it is sent, an LLM request's cost is not, so a tenant's deficit is charged afterwards with
the GPU ms it actually spent (``dt / B`` and its prefill) and may go negative. A tenant is served while
its deficit is positive; when every backlogged tenant is at or below zero, a round adds ``quantum_ms *
weight`` to each, in turn. A tenant that goes idle (nothing queued, nothing running)
forfeits a positive deficit (no banking) but keeps a debt.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from fairgate.core.policy import QueuedPolicy
from fairgate.core.request import Request, RunningView

_TOLERANCE_MS = 1e-9


class DeficitRoundRobin(QueuedPolicy):
    """DRR charged with GPU ms as spent (see module docstring).

    Args:
        quantum_ms: GPU ms of credit a tenant of weight 1 gets per round (> 0).
        weights: tenant -> weight (> 0); absent tenants weigh 1.
    """

    name = "drr"

    def __init__(self, quantum_ms: float = 50.0, weights: Mapping[str, float] | None = None) -> None:
        super().__init__()
        if not quantum_ms > 0:
            raise ValueError(f"quantum_ms must be > 0, got {quantum_ms}")
        self._quantum_ms = quantum_ms
        self._weights = dict(weights or {})
        self.deficits: dict[str, float] = {}
        self._turns: deque[str] = deque()
        self._in_flight: dict[str, int] = {}

    def _on_backlogged(self, tenant: str, now_ms: float) -> None:
        self._turns.append(tenant)
        self.deficits.setdefault(tenant, 0.0)

    def _on_idle(self, tenant: str, now_ms: float) -> None:
        self._turns.remove(tenant)
        if not self._in_flight.get(tenant, 0):
            self.deficits[tenant] = min(self.deficits[tenant], 0.0)

    def _on_pick(self, request: Request, now_ms: float) -> None:
        self._in_flight[request.tenant] = self._in_flight.get(request.tenant, 0) + 1

    def finish(self, request: Request, now_ms: float) -> None:
        left = self._in_flight[request.tenant] - 1
        self._in_flight[request.tenant] = left
        if not left and request.tenant not in self._queues:
            self.deficits[request.tenant] = min(self.deficits[request.tenant], 0.0)

    def _select(self, now_ms: float, running: RunningView) -> str | None:
        turns, deficits = self._turns, self.deficits
        # Every pass either finds a tenant in credit or gives each one a quantum: bounded by the
        # deepest debt over the smallest quantum.
        while True:
            for _ in range(len(turns)):
                tenant = turns[0]
                if deficits[tenant] > _TOLERANCE_MS:
                    return tenant
                turns.rotate(-1)
                following = turns[0]
                deficits[following] += self._quantum_ms * self._weights.get(following, 1.0)

    def charge(self, tenant: str, gpu_ms: float, input_tokens: int, output_tokens: int, batch_size: int) -> None:
        if tenant in self.deficits:
            self.deficits[tenant] -= gpu_ms
        else:
            self.deficits[tenant] = -gpu_ms
