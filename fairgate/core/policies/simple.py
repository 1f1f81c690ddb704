"""Work-conserving policies that ignore cost: first-come-first-served and round robin."""

from __future__ import annotations

from collections import deque

from fairgate.core.policy import QueuedPolicy
from fairgate.core.request import RunningView


class FCFS(QueuedPolicy):
    """First-come-first-served across all tenants: the oldest waiting request goes next.

    Source: the baseline of seed 002 (``first-come-first-served``, max/min 1.18) and of vLLM's
    default FCFS request queue.
    """

    name = "fcfs"

    def _select(self, now_ms: float, running: RunningView) -> str | None:
        return self._earliest()


class RoundRobin(QueuedPolicy):
    """Round robin over backlogged tenants, one request per turn (Nagle's fair queuing by requests).

    Source: seed 003 ("take tasks from each active tenant in rotation"); it counts requests, not cost.
    """

    name = "round_robin"

    def __init__(self) -> None:
        super().__init__()
        self._turns: deque[str] = deque()

    def _on_backlogged(self, tenant: str, now_ms: float) -> None:
        self._turns.append(tenant)

    def _on_idle(self, tenant: str, now_ms: float) -> None:
        self._turns.remove(tenant)

    def _select(self, now_ms: float, running: RunningView) -> str | None:
        tenant = self._turns[0]
        self._turns.rotate(-1)  # served: to the back (removed by _on_idle if its queue empties)
        return tenant
