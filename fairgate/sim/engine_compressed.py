"""The event-compressed engine: same results as ``engine_reference``, without visiting every iteration.

Between two scheduling events a replica's batch is constant, so every iteration there lasts
``dt = iter_base + iter_slope * B`` and charges each running sequence ``dt / B``. The engine keeps, per
replica, a *segment*: the head iteration started at the last event (with its prefill), then identical
decode iterations. It jumps straight to the next boundary where something can change:

- a sequence finishes (its finishing iteration index is known at admission: N output tokens, N
  iterations);
- a slot is free and a request the policy has not seen arrives, a held request may wake up, or the
  policy's state changed since this replica last asked it (another replica admitted or finished);
- the run's end (the workload's window, or none when the run drains).

Charges of skipped iterations are booked in bulk (``k`` iterations x ``n`` sequences of a tenant) just
before anything reads them, so the policy sees the same counters at every decision. Time is integer
ns, so boundaries computed as ``head + k * dt`` equal the reference's repeated additions exactly.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from fairgate.core.cost import NS_PER_MS, CostModel
from fairgate.core.policy import Policy
from fairgate.sim.admission import Admission
from fairgate.sim.engine_reference import SAMPLE_EVERY_NS, stop_ns
from fairgate.sim.result import SimResult
from fairgate.sim.workload import Workload


class _Replica:
    """One replica's segment (see module docstring)."""

    __slots__ = (
        "accounted_end",
        "accounted_iterations",
        "busy",
        "dt",
        "end_boundary",
        "epoch_seen",
        "finishes",
        "head_end",
        "head_iteration",
        "index",
        "per_sequence_ms",
        "size",
        "slot_charge_ms",
        "stopped",
        "tenant_running",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.busy = False
        self.stopped = False
        self.size = 0  # running sequences (B)
        self.dt = 0  # decode-only iteration time at B, ns
        self.per_sequence_ms = 0.0
        self.head_end = 0  # end of the segment's first iteration, ns
        self.head_iteration = 0  # index of that iteration on this replica (1-based)
        self.end_boundary = 0  # the segment's first boundary at or after the run's end, ns
        self.accounted_end = 0  # end of the last iteration whose charges are booked, ns
        self.accounted_iterations = 0
        self.slot_charge_ms = 0.0  # cumulative charge of one slot over the booked iterations
        self.tenant_running: dict[int, int] = {}  # tenant index -> running sequences here
        self.finishes: list[tuple[int, int]] = []  # heap of (finishing iteration, request id)
        self.epoch_seen = -1

    def boundary_at_or_after(self, t: int) -> int:
        if t <= self.head_end:
            return self.head_end
        return self.head_end - (-(t - self.head_end) // self.dt) * self.dt

    def is_boundary(self, t: int) -> bool:
        return t == self.head_end or (t > self.head_end and (t - self.head_end) % self.dt == 0)


@dataclass(slots=True)
class _Requests:
    """Per request, what its settlement needs: the replica's iteration count and slot charge at admission."""

    admitted_iteration: list[int]  # iterations booked on its replica before it joined
    slot_charge_at_admit: list[float]


def run_compressed(
    workload: Workload, cost: CostModel, policy: Policy, replicas: int = 1, *, drain: bool = False
) -> SimResult:
    """Simulate ``workload`` like ``run_reference`` does, jumping over uneventful iterations.

    Args:
        drain: run until the last request has finished (as a real server drains its queue), instead of
            starting no iteration at or after ``workload.duration_ns``.

    Returns:
        The run's ``SimResult``, equal to the reference engine's (decisions and times exactly,
        charges to float rounding).
    """
    workload.check()
    result = SimResult.empty(workload, replicas)
    admission = Admission(workload, policy, cost, result)
    duration_ns = stop_ns(workload, drain)
    reps = [_Replica(r) for r in range(replicas)]
    requests = _Requests([0] * len(workload), [0.0] * len(workload))
    admit_and_start = _starting(workload, cost, admission, result, requests, duration_ns)
    next_event = _next_event(admission, cost.max_batch)
    book, boundary, settle_request = _booking(workload, admission, result, requests, admit_and_start, duration_ns)
    if replicas == 1:
        now = _run_one(reps[0], admission, cost.max_batch, duration_ns, boundary, admit_and_start, next_event)
    else:
        now = _run_many(reps, admission, cost.max_batch, duration_ns, book, boundary, admit_and_start, next_event)
    for rep in reps:
        for _, i in rep.finishes:
            settle_request(rep, i)
    admission.sample(max(now, 0))
    return result


_NEVER = 1 << 80  # later than any instant: a draining run's end is 2**62 ns
ASK = -1  # ``next_event``'s wake-up not asked yet (a wake-up is an instant, >= 0)


def _run_one(
    rep: _Replica,
    admission: Admission,
    max_batch: int,
    duration_ns: int,
    boundary: Callable[[_Replica, int, bool], None],
    admit_and_start: Callable[[_Replica, int], None],
    next_event: Callable[[_Replica, int, int | None], int],
) -> int:
    """``_run_many``'s loop for a lone replica (most runs): a busy replica's next event is its own boundary,
    booked in one go; an idle one waits for an arrival or a wake-up. Returns the last instant."""
    queued, wake_ns, sample = admission.policy.queued, admission.wake_ns, admission.sample
    now = -1
    next_sample = 0
    while True:
        # The policy's wake-up (a quota's reads every held tenant's bucket) is asked only when it could be the
        # next event: mostly an arrival or a finish comes first. The state it reads is the one the last event
        # left, as if asked then.
        if rep.busy:
            now = next_event(rep, now, ASK)
            boundary(rep, now, True)
        elif rep.stopped:
            break
        else:
            arrival = admission.next_arrival_ns
            best = _NEVER if arrival is None else max(arrival, now + 1)
            if best > now + 1 and now >= 0:
                wake = wake_ns(now)
                if wake is not None and wake < duration_ns and wake < best:
                    best = wake
            if best == _NEVER:
                break
            now = best
        if now < duration_ns and not rep.busy and not rep.stopped:
            arrival = admission.next_arrival_ns
            if (arrival is not None and arrival <= now) or queued():
                admit_and_start(rep, now)
        if now >= next_sample:
            sample(now)
            next_sample = now + SAMPLE_EVERY_NS
    return now


def _run_many(
    reps: list[_Replica],
    admission: Admission,
    max_batch: int,
    duration_ns: int,
    book: Callable[[_Replica, int, bool], None],
    boundary: Callable[[_Replica, int, bool], None],
    admit_and_start: Callable[[_Replica, int], None],
    next_event: Callable[[_Replica, int, int | None], int],
) -> int:
    """The event loop: jump to the earliest instant anything can change on any replica, book every replica
    up to it, handle the replicas at a boundary there, then the idle ones. Returns the last instant."""
    policy = admission.policy
    now = -1
    wake: int | None = None
    next_sample = 0
    while True:
        best = _NEVER
        idle = False
        for rep in reps:
            if rep.busy:
                t = next_event(rep, now, wake)
                if t < best:
                    best = t
            elif not rep.stopped:
                idle = True
        if idle:
            arrival = admission.next_arrival_ns
            if arrival is not None:
                best = min(best, max(arrival, now + 1))
            if wake is not None and wake < duration_ns:
                best = min(best, wake)
        if best == _NEVER:
            break
        now = best
        at_boundary = [rep for rep in reps if rep.busy and rep.is_boundary(now)]
        for rep in reps:
            # A lone replica at its boundary books everything up to it in one go below; otherwise
            # iterations before `now` must be booked before any replica picks at `now`.
            if len(at_boundary) != 1 or rep is not at_boundary[0]:
                book(rep, now, False)
        for rep in at_boundary:
            boundary(rep, now, True)
        if now < duration_ns:
            for rep in reps:
                if not rep.busy and not rep.stopped and (admission.has_undelivered_until(now) or policy.queued()):
                    admit_and_start(rep, now)
        free = any(not rep.stopped and rep.size < max_batch for rep in reps)
        wake = admission.wake_ns(now) if free and policy.queued() else None  # as in _run_one
        if now >= next_sample:
            admission.sample(now)
            next_sample = now + SAMPLE_EVERY_NS
    return now


def _booking(
    workload: Workload,
    admission: Admission,
    result: SimResult,
    requests: _Requests,
    admit_and_start: Callable[[_Replica, int], None],
    duration_ns: int,
) -> tuple[
    Callable[[_Replica, int, bool], None], Callable[[_Replica, int, bool], None], Callable[[_Replica, int], None]
]:
    """The engine's booking steps, as closures over the run's arrays (the hot path: no attribute look-ups):
    ``book(rep, upto, inclusive)``, ``boundary(rep, t, inclusive)`` (book, then settle the finishes due and
    start the next segment), ``settle_request(rep, i)``."""
    tenants, tenant_index = workload.tenants, workload.tenant_index
    tenant_gpu_ms, tenant_decode_tokens = result.tenant_gpu_ms, result.tenant_decode_tokens
    busy_ns, iterations, request_gpu_ms, generated_tokens = (
        result.busy_ns,
        result.iterations,
        result.request_gpu_ms,
        result.generated_tokens,
    )
    charge, finish = admission.admitter.charge, admission.finish
    admitted_iteration, slot_charge_at_admit = requests.admitted_iteration, requests.slot_charge_at_admit
    heappop = heapq.heappop

    def book(rep: _Replica, upto: int, inclusive: bool) -> None:
        """Book every iteration of ``rep`` ending before ``upto`` (or at it, if ``inclusive``)."""
        if not rep.busy:
            return
        dt = rep.dt
        first = rep.head_end if rep.accounted_iterations < rep.head_iteration else rep.accounted_end + dt
        if upto < first or (upto == first and not inclusive):
            return
        span = upto - first
        k = span // dt + 1
        if not inclusive and span % dt == 0:
            k -= 1
        size, per = rep.size, rep.per_sequence_ms
        for k_tenant, running in rep.tenant_running.items():
            tokens = k * running
            ms = tokens * per
            charge(tenants[k_tenant], ms, 0, tokens, size)
            tenant_gpu_ms[k_tenant] += ms
            tenant_decode_tokens[k_tenant] += tokens
        rep.slot_charge_ms += k * per
        rep.accounted_iterations += k
        rep.accounted_end = first + (k - 1) * dt
        busy_ns[rep.index] += k * dt
        iterations[rep.index] += k

    def boundary(rep: _Replica, t: int, inclusive: bool) -> None:
        """``rep`` reached a boundary at ``t``: book up to it, settle the sequences finishing there (in request
        id order), then start its next segment (or stop it at the run's end)."""
        book(rep, t, inclusive)
        finishes, done = rep.finishes, rep.accounted_iterations
        if finishes and finishes[0][0] == done:
            running, charged = rep.tenant_running, rep.slot_charge_ms
            while finishes and finishes[0][0] == done:
                i = heappop(finishes)[1]
                request_gpu_ms[i] += charged - slot_charge_at_admit[i]
                generated_tokens[i] = done - admitted_iteration[i]
                k_tenant = tenant_index[i]
                left = running[k_tenant] - 1
                if left:
                    running[k_tenant] = left
                else:
                    del running[k_tenant]
                rep.size -= 1
                finish(i, t)
        assert not finishes or finishes[0][0] > done, "a finish was skipped"
        if t < duration_ns:
            admit_and_start(rep, t)
        else:
            rep.busy, rep.stopped = False, True

    def settle_request(rep: _Replica, i: int) -> None:
        request_gpu_ms[i] += rep.slot_charge_ms - slot_charge_at_admit[i]
        generated_tokens[i] = rep.accounted_iterations - admitted_iteration[i]

    return book, boundary, settle_request


def _starting(
    workload: Workload, cost: CostModel, admission: Admission, result: SimResult, requests: _Requests, duration_ns: int
) -> Callable[[_Replica, int], None]:
    """The engine's admission step, as a closure: ``admit_and_start(rep, t)`` (fill free slots, start a
    segment)."""
    tenant_index, prompt_tokens, output_tokens = workload.tenant_index, workload.prompt_tokens, workload.output_tokens
    admitted_iteration, slot_charge_at_admit = requests.admitted_iteration, requests.slot_charge_at_admit
    first_token_ns, busy_ns = result.first_token_ns, result.busy_ns
    max_batch, admit = cost.max_batch, admission.admit
    decode_ns, prefill_ns = cost.decode_ns, cost.prefill_ns
    heappush = heapq.heappush

    def admit_and_start(rep: _Replica, t: int) -> None:
        size = rep.size
        admitted = admit(t, rep.index, max_batch - size, size)
        rep.epoch_seen = admission.epoch
        if admitted:
            running, done, charged, finishes = (
                rep.tenant_running,
                rep.accounted_iterations,
                rep.slot_charge_ms,
                rep.finishes,
            )
            prefill_tokens = 0
            for i in admitted:
                k_tenant = tenant_index[i]
                running[k_tenant] = running.get(k_tenant, 0) + 1
                prefill_tokens += prompt_tokens[i]
                admitted_iteration[i] = done
                slot_charge_at_admit[i] = charged
                heappush(finishes, (done + output_tokens[i], i))
            size += len(admitted)
            rep.size = size
        elif size == 0:
            rep.busy = False
            return
        else:
            prefill_tokens = 0
        rep.busy = True
        dt = rep.dt = decode_ns(size)
        rep.per_sequence_ms = dt / size / NS_PER_MS
        prefill = prefill_ns(prefill_tokens)
        head_end = rep.head_end = t + dt + prefill
        rep.head_iteration = rep.accounted_iterations + 1
        rep.accounted_end = t
        rep.end_boundary = rep.boundary_at_or_after(duration_ns)
        busy_ns[rep.index] += prefill
        for i in admitted:
            first_token_ns[i] = head_end

    return admit_and_start


def _next_event(admission: Admission, max_batch: int) -> Callable[[_Replica, int, int | None], int]:
    """``next_event(rep, now, wake)``: the next boundary of ``rep`` where something can change, given the
    policy's wake-up asked at ``now`` (or ``ASK``: asked there only if it can come first)."""
    policy, wake_ns = admission.policy, admission.wake_ns

    def next_event(rep: _Replica, now: int, wake: int | None) -> int:
        dt, head_end = rep.dt, rep.head_end
        best = rep.end_boundary
        if rep.finishes:
            finish = head_end + (rep.finishes[0][0] - rep.head_iteration) * dt
            if finish < best:
                best = finish
        if rep.size < max_batch:
            # the first boundary at or after ``t`` (> now), for each instant a free slot may be filled; none
            # comes before the first boundary after ``now``
            t = now + 1
            soonest = head_end if t <= head_end else head_end - (-(t - head_end) // dt) * dt
            if best <= soonest:
                return best
            arrival = admission.next_arrival_ns
            if arrival is not None:
                t = max(arrival, now + 1)
                best = min(best, head_end if t <= head_end else head_end - (-(t - head_end) // dt) * dt)
            if policy.queued():
                if rep.epoch_seen != admission.epoch:
                    best = min(best, soonest)
                if best > soonest:
                    if wake == ASK:
                        wake = wake_ns(now)
                    if wake is not None:
                        t = max(wake, now + 1)
                        best = min(best, head_end if t <= head_end else head_end - (-(t - head_end) // dt) * dt)
        return best

    return next_event
