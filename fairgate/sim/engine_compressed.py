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
from fairgate.core.policy import Policy, QueuedPolicy
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

    def is_boundary(self, t: int) -> bool:
        return t == self.head_end or (t > self.head_end and (t - self.head_end) % self.dt == 0)


@dataclass(slots=True)
class _Requests:
    """Per request, what its settlement needs: the replica's iteration count and slot charge at admission."""

    admitted_iteration: list[int]  # iterations booked on its replica before it joined
    slot_charge_at_admit: list[float]


# Fill the free slots of a replica and start its next segment (see ``_starting``); book a replica up to an instant.
_Start = Callable[[int, int, int, int, float, dict[int, int], list[tuple[int, int]]], tuple[int, int, float, int, int]]
_Step = Callable[[_Replica, int, bool], None]


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
    requests = _Requests([0] * len(workload), [0.0] * len(workload))
    start = _starting(workload, cost, admission, result, requests, duration_ns)
    if replicas == 1:
        now = _run_one(workload, admission, result, requests, start, duration_ns)
    else:
        reps = [_Replica(r) for r in range(replicas)]
        book, boundary, admit_and_start, settle_request = _booking(
            workload, admission, result, requests, start, duration_ns
        )
        now = _run_many(reps, admission, duration_ns, book, boundary, admit_and_start)
        for rep in reps:
            for _, i in rep.finishes:
                settle_request(rep, i)
    admission.sample(max(now, 0))
    return result


_NEVER = 1 << 80  # later than any instant: a draining run's end is 2**62 ns


def _takes_charges(policy: Policy) -> bool:
    """Whether ``policy`` reads what is charged: first-come-first-served, round robin, the request quota and the
    slot cap do not (``QueuedPolicy.charge``), and are not called with each booking's."""
    return getattr(type(policy), "charge", None) is not QueuedPolicy.charge


def _run_one(
    workload: Workload, admission: Admission, result: SimResult, requests: _Requests, start: _Start, duration_ns: int
) -> int:
    """``_run_many`` for a lone replica (most runs), fused into one loop over local variables: the same
    instants, bookings and calls in the same order, without a call or an attribute look-up per step. A busy
    replica's instant is its own boundary, booked in one go; an idle one waits for an arrival or a wake-up.
    Returns the last instant."""
    tenants, tenant_index, tenant_gpu_ms = workload.tenants, workload.tenant_index, result.tenant_gpu_ms
    tenant_decode_tokens, request_gpu_ms = result.tenant_decode_tokens, result.request_gpu_ms
    generated_tokens, busy_ns, iterations = result.generated_tokens, result.busy_ns, result.iterations
    admitted_iteration = requests.admitted_iteration
    slot_charge_at_admit, heappop, max_batch = requests.slot_charge_at_admit, heapq.heappop, admission.cost.max_batch
    queued, sample, finish = admission.policy.queued, admission.sample, admission.finish
    charge = admission.admitter.charge if _takes_charges(admission.policy) else None
    running: dict[int, int] = {}  # tenant index -> running sequences
    finishes: list[tuple[int, int]] = []  # heap of (finishing iteration, request id)
    busy = stopped = False
    size = dt = head_end = head_iteration = accounted_end = done = epoch_seen = 0  # as in _Replica
    per = charged = 0.0  # _Replica's per_sequence_ms and slot_charge_ms
    decode_ns = 0  # busy time of the booked iterations less their prefill (``start`` books that), ns
    now, next_sample = -1, 0
    while True:
        if busy:
            best = head_end + (finishes[0][0] - head_iteration) * dt if finishes else _NEVER
            if best >= duration_ns:  # the segment's first boundary at or after the run's end may come first
                best = min(best, head_end - (-max(duration_ns - head_end, 0) // dt) * dt)
            if size < max_batch:
                best = _first_change(admission, now, best, head_end, dt, epoch_seen)
            now = best
            first = head_end if done < head_iteration else accounted_end + dt
            if now >= first:  # book every iteration up to `now`, in one go
                k = (now - first) // dt + 1
                for k_tenant, n_running in running.items():
                    tokens = k * n_running
                    ms = tokens * per
                    if charge is not None:
                        charge(tenants[k_tenant], ms, 0, tokens, size)
                    tenant_gpu_ms[k_tenant] += ms
                    tenant_decode_tokens[k_tenant] += tokens
                charged += k * per
                done += k
                accounted_end = first + (k - 1) * dt
                decode_ns += k * dt
            while finishes and finishes[0][0] == done:  # in request id order, as the reference's
                i = heappop(finishes)[1]
                request_gpu_ms[i] += charged - slot_charge_at_admit[i]
                generated_tokens[i] = done - admitted_iteration[i]
                k_tenant = tenant_index[i]
                left = running[k_tenant] - 1
                if left:
                    running[k_tenant] = left
                else:
                    del running[k_tenant]
                size -= 1
                finish(i, now)
            assert not finishes or finishes[0][0] > done, "a finish was skipped"
            if now < duration_ns:
                size, dt, per, head_end, epoch_seen = start(0, now, size, done, charged, running, finishes)
                busy, head_iteration, accounted_end = size > 0, done + 1, now
            else:
                busy, stopped = False, True
        else:
            t = _NEVER if stopped else _idle_until(admission, now, duration_ns)
            if t == _NEVER:
                break
            now = t
        if now < duration_ns and not busy and not stopped:
            arrival = admission.next_arrival_ns
            if (arrival is not None and arrival <= now) or queued():
                size, dt, per, head_end, epoch_seen = start(0, now, size, done, charged, running, finishes)
                busy, head_iteration, accounted_end = size > 0, done + 1, now
        if now >= next_sample:
            sample(now)
            next_sample = now + SAMPLE_EVERY_NS
    for _, i in finishes:
        request_gpu_ms[i] += charged - slot_charge_at_admit[i]
        generated_tokens[i] = done - admitted_iteration[i]
    busy_ns[0] += decode_ns  # integers: the same sum booked once
    iterations[0] = done  # every iteration is booked, and only here
    return now


def _first_change(admission: Admission, now: int, best: int, head_end: int, dt: int, epoch_seen: int) -> int:
    """The earlier of ``best`` and the first boundary (segment ``head_end``, ``dt``) after ``now`` where a free
    slot may be filled: a request the policy has not seen arrived, the policy's state changed since the
    replica last asked it (``epoch_seen``), or a held request may wake up. None comes before the first boundary
    after ``now``; the policy's wake-up (a quota's reads every held tenant's bucket) is asked only when it could
    come first - the state it reads is the one the last event left, as if asked then."""
    t = now + 1
    soonest = head_end if t <= head_end else head_end - (-(t - head_end) // dt) * dt
    if best <= soonest:
        return best
    arrival = admission.next_arrival_ns
    if arrival is not None:
        t = max(arrival, now + 1)
        best = min(best, head_end if t <= head_end else head_end - (-(t - head_end) // dt) * dt)
    if admission.policy.queued():
        if epoch_seen != admission.epoch:
            best = min(best, soonest)
        if best > soonest:
            wake = admission.wake_ns(now)
            if wake is not None:
                t = max(wake, now + 1)
                best = min(best, head_end if t <= head_end else head_end - (-(t - head_end) // dt) * dt)
    return best


def _idle_until(admission: Admission, now: int, duration_ns: int) -> int:
    """When an idle replica may next admit, after ``now``: an arrival, or a held request's wake-up (asked only if
    it could come first); ``_NEVER`` if neither will happen."""
    arrival = admission.next_arrival_ns
    best = _NEVER if arrival is None else max(arrival, now + 1)
    if best > now + 1 and now >= 0:
        wake = admission.wake_ns(now)
        if wake is not None and wake < duration_ns and wake < best:
            best = wake
    return best


def _run_many(
    reps: list[_Replica],
    admission: Admission,
    duration_ns: int,
    book: _Step,
    boundary: _Step,
    admit_and_start: Callable[[_Replica, int], None],
) -> int:
    """The event loop: jump to the earliest instant anything can change on any replica, book every replica
    up to it, handle the replicas at a boundary there, then the idle ones. Returns the last instant."""
    policy, max_batch = admission.policy, admission.cost.max_batch
    now = -1
    wake: int | None = None
    next_sample = 0
    while True:
        best = _NEVER
        idle = False
        for rep in reps:
            if rep.busy:
                t = rep.end_boundary
                if rep.finishes:
                    t = min(t, rep.head_end + (rep.finishes[0][0] - rep.head_iteration) * rep.dt)
                if rep.size < max_batch:
                    t = _first_change(admission, now, t, rep.head_end, rep.dt, rep.epoch_seen)
                best = min(best, t)
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
        idle = any(not rep.busy and not rep.stopped for rep in reps)
        wake = admission.wake_ns(now) if idle and policy.queued() else None  # read by idle replicas only
        if now >= next_sample:
            admission.sample(now)
            next_sample = now + SAMPLE_EVERY_NS
    return now


def _booking(
    workload: Workload, admission: Admission, result: SimResult, requests: _Requests, start: _Start, duration_ns: int
) -> tuple[_Step, _Step, Callable[[_Replica, int], None], Callable[[_Replica, int], None]]:
    """``_run_many``'s steps, as closures over the run's arrays: ``book(rep, upto, inclusive)``,
    ``boundary(rep, t, inclusive)`` (book, then settle the finishes due and start the next segment),
    ``admit_and_start(rep, t)`` and ``settle_request(rep, i)``."""
    tenants, tenant_index = workload.tenants, workload.tenant_index
    tenant_gpu_ms, tenant_decode_tokens = result.tenant_gpu_ms, result.tenant_decode_tokens
    busy_ns, iterations, request_gpu_ms, generated_tokens = (
        result.busy_ns,
        result.iterations,
        result.request_gpu_ms,
        result.generated_tokens,
    )
    charge, finish = admission.admitter.charge, admission.finish
    charged = _takes_charges(admission.policy)
    admitted_iteration, slot_charge_at_admit = requests.admitted_iteration, requests.slot_charge_at_admit

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
            if charged:
                charge(tenants[k_tenant], ms, 0, tokens, size)
            tenant_gpu_ms[k_tenant] += ms
            tenant_decode_tokens[k_tenant] += tokens
        rep.slot_charge_ms += k * per
        rep.accounted_iterations += k
        rep.accounted_end = first + (k - 1) * dt
        busy_ns[rep.index] += k * dt
        iterations[rep.index] += k

    def boundary(rep: _Replica, t: int, inclusive: bool) -> None:
        book(rep, t, inclusive)
        finishes, done = rep.finishes, rep.accounted_iterations
        while finishes and finishes[0][0] == done:  # in request id order, as the reference's
            i = heapq.heappop(finishes)[1]
            settle_request(rep, i)
            k_tenant = tenant_index[i]
            left = rep.tenant_running[k_tenant] - 1
            if left:
                rep.tenant_running[k_tenant] = left
            else:
                del rep.tenant_running[k_tenant]
            rep.size -= 1
            finish(i, t)
        assert not finishes or finishes[0][0] > done, "a finish was skipped"
        if t < duration_ns:
            admit_and_start(rep, t)
        else:
            rep.busy, rep.stopped = False, True

    def admit_and_start(rep: _Replica, t: int) -> None:
        done = rep.accounted_iterations
        size, dt, per, head_end, rep.epoch_seen = start(
            rep.index, t, rep.size, done, rep.slot_charge_ms, rep.tenant_running, rep.finishes
        )
        rep.size, rep.busy = size, size > 0
        rep.dt, rep.per_sequence_ms, rep.head_end = dt, per, head_end
        if size:
            rep.end_boundary = head_end - (-max(duration_ns - head_end, 0) // dt) * dt
        rep.head_iteration, rep.accounted_end = done + 1, t

    def settle_request(rep: _Replica, i: int) -> None:
        request_gpu_ms[i] += rep.slot_charge_ms - slot_charge_at_admit[i]
        generated_tokens[i] = rep.accounted_iterations - admitted_iteration[i]

    return book, boundary, admit_and_start, settle_request


def _starting(
    workload: Workload, cost: CostModel, admission: Admission, result: SimResult, requests: _Requests, duration_ns: int
) -> _Start:
    """``start(index, t, size, done, charged, running, finishes)``: fill the free slots of replica ``index`` at
    ``t`` - ``size`` sequences running (``running``: per tenant; ``finishes``: their heap), ``done`` iterations
    and ``charged`` ms a slot booked - and start its next segment. Returns the segment: ``(size, dt,
    per_sequence_ms, head_end, epoch)``; ``size`` 0: the replica idles."""
    tenant_index, output_tokens = workload.tenant_index, workload.output_tokens
    admitted_iteration, slot_charge_at_admit = requests.admitted_iteration, requests.slot_charge_at_admit
    first_token_ns, busy_ns, admit_ns, admissions = (
        result.first_token_ns,
        result.busy_ns,
        result.admit_ns,
        result.admissions,
    )
    tenant_gpu_ms, tenant_prefill_ms, request_gpu_ms = (
        result.tenant_gpu_ms,
        result.tenant_prefill_ms,
        result.request_gpu_ms,
    )
    max_batch, pick = cost.max_batch, admission.pick
    decode_ns, prefill_ns = cost.decode_ns, cost.prefill_ns
    heappush = heapq.heappush

    def start(
        index: int,
        t: int,
        size: int,
        done: int,
        charged: float,
        running: dict[int, int],
        finishes: list[tuple[int, int]],
    ) -> tuple[int, int, float, int, int]:
        picked = pick(t, max_batch - size, size)
        prefill_tokens = 0
        if picked:
            for request, prefill_ms in picked:
                i = request.request_id
                k_tenant = tenant_index[i]
                tenant_gpu_ms[k_tenant] += prefill_ms  # ``book_admission``, written out
                tenant_prefill_ms[k_tenant] += prefill_ms
                request_gpu_ms[i] += prefill_ms
                admit_ns[i] = t
                admissions.append((i, index, t))
                running[k_tenant] = running.get(k_tenant, 0) + 1
                prefill_tokens += request.prompt_tokens
                admitted_iteration[i] = done
                slot_charge_at_admit[i] = charged
                heappush(finishes, (done + output_tokens[i], i))
            size += len(picked)
        elif size == 0:
            return 0, 0, 0.0, 0, admission.epoch
        dt = decode_ns(size)
        prefill = prefill_ns(prefill_tokens)
        head_end = t + dt + prefill
        busy_ns[index] += prefill
        for request, _ in picked:
            first_token_ns[request.request_id] = head_end
        return size, dt, dt / size / NS_PER_MS, head_end, admission.epoch

    return start
