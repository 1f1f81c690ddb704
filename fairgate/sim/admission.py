"""The simulator's side of the admit step (``fairgate.core.admit``, which the gateway's dispatcher runs
too): hand arrivals to the policy, fill free slots, record what each admission and finish did in the
result. Both engines share it.

Arrivals are handed to the policy lazily, at the next scheduling point (a replica boundary with a
free slot, or an idle replica) rather than at their arrival instant: no decision is made between the
two, and it lets the event-compressed engine skip the iterations in between. ``Request.arrival_ms``
keeps the true arrival time, so FCFS order is unaffected.
"""

from __future__ import annotations

import math
from bisect import bisect_right

from fairgate.core.admit import Admitter
from fairgate.core.cost import NS_PER_MS, CostModel
from fairgate.core.policy import Policy
from fairgate.core.request import Request
from fairgate.sim.result import SimResult
from fairgate.sim.workload import Workload


class Admission:
    """Owns the policy-facing side of a run: delivery, picks, the running view, finishes.

    Attributes read on the engines' hot path, kept current rather than computed per read:
        epoch: changes whenever the policy's state may have changed (a delivery, an admission, a finish).
        next_arrival_ns: arrival time of the first request not yet handed to the policy (None: all were).
    """

    __slots__ = (
        "admitted",
        "admitter",
        "cost",
        "delivered",
        "epoch",
        "finished",
        "next_arrival_ns",
        "policy",
        "requests",
        "result",
        "workload",
    )

    def __init__(self, workload: Workload, policy: Policy, cost: CostModel, result: SimResult) -> None:
        self.workload = workload
        self.policy = policy
        self.admitter = Admitter(policy)
        self.cost = cost
        self.result = result
        self.delivered = 0  # requests [0, delivered) have been handed to the policy
        self.requests: list[Request] = workload.requests()
        self.admitted = 0  # requests picked
        self.finished = 0  # requests that left their slot
        self.epoch = 0  # delivered + admitted + finished
        self.next_arrival_ns: int | None = workload.arrival_ns[0] if len(workload) else None

    def has_undelivered_until(self, t_ns: int) -> bool:
        """Has a request arrived by ``t_ns`` that the policy has not seen yet?"""
        return self.next_arrival_ns is not None and self.next_arrival_ns <= t_ns

    def next_undelivered_ns(self) -> int | None:
        """Arrival time of the first request not yet handed to the policy."""
        return self.next_arrival_ns

    def deliver(self, t_ns: int) -> None:
        """Hand every request that arrived by ``t_ns`` to the policy, in arrival order."""
        if self.next_arrival_ns is None or self.next_arrival_ns > t_ns:
            return
        arrival_ns, first = self.workload.arrival_ns, self.delivered
        n = len(arrival_ns)
        delivered = bisect_right(arrival_ns, t_ns, first)
        self.admitter.enqueue_all(self.requests[first:delivered], t_ns / NS_PER_MS)
        self.delivered = delivered
        self.epoch += delivered - first
        self.next_arrival_ns = arrival_ns[delivered] if delivered < n else None

    def admit(self, t_ns: int, replica: int, free_slots: int, running_now: int) -> list[int]:
        """Fill up to ``free_slots`` slots of ``replica`` at ``t_ns``; returns the admitted request ids.

        Arrivals are handed over only when a slot is free (a full replica makes no decision). The admit
        step charges each admitted request's prefill to the policy; it is booked in the result too.
        """
        picked = self.pick(t_ns, free_slots, running_now)
        if not picked:
            return []
        result, tenant_index = self.result, self.workload.tenant_index
        admitted: list[int] = []
        for request, prefill_ms in picked:
            i = request.request_id
            book_admission(result, tenant_index[i], i, prefill_ms, t_ns, replica)
            admitted.append(i)
        return admitted

    def pick(self, t_ns: int, free_slots: int, running_now: int) -> list[tuple[Request, float]]:
        """``admit``'s policy side alone: the requests picked for up to ``free_slots`` slots at ``t_ns`` and their
        prefill charges, which the caller books in the result as ``admit`` does (the compressed engine, in the
        same pass as its replica's)."""
        if free_slots <= 0:
            return []
        if self.next_arrival_ns is not None and self.next_arrival_ns <= t_ns:
            self.deliver(t_ns)
        # An empty queue's pick is None and changes nothing (``Policy``'s contract): nothing is asked before it.
        picked = self.admitter.fill(t_ns / NS_PER_MS, free_slots, running_now, self.cost)
        if picked:
            self.admitted += len(picked)
            self.epoch += len(picked)
        return picked

    def finish(self, request_id: int, t_ns: int) -> None:
        """Request ``request_id`` generated its last token at the boundary ``t_ns``."""
        self.finished += 1
        self.epoch += 1
        self.result.finish_ns[request_id] = t_ns
        self.admitter.finish(self.requests[request_id], t_ns / NS_PER_MS, int(self.workload.output_tokens[request_id]))

    def wake_ns(self, t_ns: int) -> int | None:
        """When a held request may become eligible (integer ns, > ``t_ns``), or ``None``."""
        if not self.policy.queued():
            return None
        wake_ms = self.admitter.wake_at(t_ns / NS_PER_MS)
        if wake_ms is None:
            return None
        return max(math.ceil(wake_ms * NS_PER_MS), t_ns + 1)

    def sample(self, t_ns: int) -> None:
        """Append a timeline point (cumulative GPU ms per tenant) at ``t_ns``."""
        self.result.timeline.append((t_ns, list(self.result.tenant_gpu_ms)))


def book_admission(result: SimResult, tenant: int, request: int, prefill_ms: float, t_ns: int, replica: int) -> None:
    """Book in ``result`` request ``request`` (of tenant index ``tenant``) admitted on ``replica`` at ``t_ns``,
    its prefill charged ``prefill_ms`` (the admit step's charge to the policy, seed 002)."""
    result.tenant_gpu_ms[tenant] += prefill_ms
    result.tenant_prefill_ms[tenant] += prefill_ms
    result.request_gpu_ms[request] += prefill_ms
    result.admit_ns[request] = t_ns
    result.admissions.append((request, replica, t_ns))
