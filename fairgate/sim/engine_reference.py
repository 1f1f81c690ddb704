"""The plain reference engine: every iteration of every replica, every running sequence, one by one.

It implements the conventions of ``shared/DESIGN.md`` literally and is the yardstick the
event-compressed engine (``engine_compressed``) must agree with exactly:

- admission happens at iteration boundaries; an idle replica starts an iteration at the instant a
  request can be admitted (its arrival, or a quota's wake-up);
- a newly admitted sequence is prefilled in the iteration it joins, counts in its ``B``, and emits its
  first token at that iteration's end: a request of N output tokens is resident for N iterations;
- each iteration charges ``(iter_base + iter_slope * B) / B`` to every running sequence and the prefill
  to each newly admitted one (the prefill is booked as the request is picked);
- events at one instant are handled in this order: arrivals up to that instant become visible, then
  replica boundaries in replica order, then idle replicas in replica order;
- no iteration starts at or after the run's duration; the ones in progress complete. A run that *drains*
  has no such end: it goes on until the last admitted request finished (requests a policy holds for ever,
  e.g. past a spent budget, stay unfinished).
"""

from __future__ import annotations

from dataclasses import dataclass

from fairgate.core.cost import NS_PER_MS, CostModel
from fairgate.core.policy import Policy
from fairgate.sim.admission import Admission
from fairgate.sim.result import SimResult
from fairgate.sim.workload import Workload

SAMPLE_EVERY_NS = 1_000 * NS_PER_MS
NO_END_NS = 2**62  # a draining run's "end": ~146 years of ns, past any arrival (traces cap replays at 10 years)


def stop_ns(workload: Workload, drain: bool) -> int:
    """The instant from which no iteration starts: the workload's window, or never when the run drains."""
    return NO_END_NS if drain else workload.duration_ns


@dataclass(slots=True)
class _Sequence:
    request_id: int
    tenant: str
    tenant_index: int
    output_tokens: int
    generated: int = 0


def _next_instant(
    iteration_end: list[int | None], stopped: list[bool], arrival: int | None, wake: int | None, duration_ns: int
) -> int | None:
    """The next instant anything happens: an iteration ends, a request arrives, or (while a replica idles) a
    held request may wake; None when nothing will."""
    candidates = [e for e in iteration_end if e is not None]
    if arrival is not None:
        candidates.append(arrival)
    idle = any(end is None and not stop for end, stop in zip(iteration_end, stopped, strict=True))
    if wake is not None and wake < duration_ns and idle:
        candidates.append(wake)  # busy replicas ask again at their own boundaries
    return min(candidates) if candidates else None


def run_reference(
    workload: Workload, cost: CostModel, policy: Policy, replicas: int = 1, *, drain: bool = False
) -> SimResult:
    """Simulate ``workload`` on ``replicas`` replicas of ``cost`` under ``policy``, iteration by iteration;
    ``drain``: until the last request finished (see the module docstring). Returns the run's ``SimResult``."""
    workload.check()
    result = SimResult.empty(workload, replicas)
    admission = Admission(workload, policy, cost, result)
    duration_ns, arrival_ns, n = stop_ns(workload, drain), workload.arrival_ns, len(workload)
    running: list[list[_Sequence]] = [[] for _ in range(replicas)]
    iteration_end: list[int | None] = [None] * replicas  # None: idle (or stopped)
    stopped = [False] * replicas
    arrived = 0  # arrivals [0, arrived) have happened by the current instant
    wake: int | None = None
    next_sample = 0
    last_t = 0
    charge = admission.admitter.charge

    def end_iteration(r: int, t: int) -> None:
        batch = running[r]
        size = len(batch)
        per_sequence_ms = cost.decode_ns(size) / size / NS_PER_MS
        for seq in batch:
            seq.generated += 1
            if seq.generated == 1:
                result.first_token_ns[seq.request_id] = t
            result.request_gpu_ms[seq.request_id] += per_sequence_ms
            result.generated_tokens[seq.request_id] += 1
            result.tenant_gpu_ms[seq.tenant_index] += per_sequence_ms
            result.tenant_decode_tokens[seq.tenant_index] += 1
            charge(seq.tenant, per_sequence_ms, 0, 1, size)
        still = [seq for seq in batch if seq.generated < seq.output_tokens]
        # Sequences ending in one iteration leave in request id order (the compressed engine's order too: a
        # policy may see who went idle last).
        for request_id in sorted(seq.request_id for seq in batch if seq.generated == seq.output_tokens):
            admission.finish(request_id, t)
        running[r] = still
        iteration_end[r] = None

    def admit_and_start(r: int, t: int) -> None:
        free = cost.max_batch - len(running[r])
        prefill_tokens = 0
        for i in admission.admit(t, r, free, len(running[r])):
            k = workload.tenant_index[i]
            running[r].append(_Sequence(i, workload.tenants[k], k, workload.output_tokens[i]))
            prefill_tokens += workload.prompt_tokens[i]
        if running[r]:
            dt = cost.decode_ns(len(running[r])) + cost.prefill_ns(prefill_tokens)
            iteration_end[r] = t + dt
            result.busy_ns[r] += dt
            result.iterations[r] += 1

    while True:
        next_arrival = arrival_ns[arrived] if arrived < n else None
        t_next = _next_instant(iteration_end, stopped, next_arrival, wake, duration_ns)
        if t_next is None:
            break
        t = last_t = t_next
        while arrived < n and arrival_ns[arrived] <= t:
            arrived += 1
        for r in range(replicas):
            if iteration_end[r] == t:
                end_iteration(r, t)
                if t < duration_ns:
                    admit_and_start(r, t)
                else:
                    stopped[r] = True
        if t < duration_ns:
            for r in range(replicas):
                if iteration_end[r] is None and not stopped[r] and (admission.delivered < arrived or policy.queued()):
                    admit_and_start(r, t)
        wake = admission.wake_ns(t)
        if t >= next_sample:
            admission.sample(t)
            next_sample = t + SAMPLE_EVERY_NS
    admission.sample(last_t)
    return result
