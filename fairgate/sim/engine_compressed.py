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

Charges of skipped iterations are booked in bulk (``k`` iterations x ``n`` sequences of a tenant; to the
policy in one ``Policy.charge_decode`` call) just before anything reads them, so the policy sees the same
counters at every decision. A request's decode charge is the growth of one cumulative charge per slot while
it ran; its decode tokens are booked to its tenant as it leaves (or at the run's end), one per iteration it
ran, rather than per tenant at every booking. Time is integer ns, so boundaries computed as ``head + k * dt``
equal the reference's repeated additions exactly.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Callable

from fairgate.core.cost import NS_PER_MS, CostModel
from fairgate.core.policy import Policy, QueuedPolicy
from fairgate.sim.admission import Admission
from fairgate.sim.engine_reference import SAMPLE_EVERY_NS, stop_ns
from fairgate.sim.result import SimResult
from fairgate.sim.workload import Workload

# A running request on a replica's heap: (the replica's iteration it finishes at, request id, the slot charge
# booked on the replica when it joined). Ids are unique, so the charge is never compared.
_Finish = tuple[int, int, float]


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
        self.tenant_running: dict[str, int] = {}  # tenant -> running sequences here
        self.finishes: list[_Finish] = []  # heap (see ``_Finish``)
        self.epoch_seen = -1

    def is_boundary(self, t: int) -> bool:
        return t == self.head_end or (t > self.head_end and (t - self.head_end) % self.dt == 0)


# Fill the free slots of a replica and start its next segment (see ``_starting``); settle the finishes due at a
# replica's boundary (``_settling``); book a replica up to an instant.
_Start = Callable[[int, int, int, int, float, dict[str, int], list[_Finish]], tuple[int, int, float, int, int]]
_Settle = Callable[[int, int, float, dict[str, int], list[_Finish]], int]
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
    start = _starting(workload, cost, admission, result, duration_ns)
    settle = _settling(workload, admission, result)
    if replicas == 1:
        now, done, charged, finishes = _run_one(admission, result, start, settle, duration_ns)
        _settle_unfinished(result, done, charged, finishes)
    else:
        reps = [_Replica(r) for r in range(replicas)]
        book, boundary, admit_and_start = _booking(workload, admission, result, start, settle, duration_ns)
        now = _run_many(reps, admission, duration_ns, book, boundary, admit_and_start)
        for rep in reps:
            _settle_unfinished(result, rep.accounted_iterations, rep.slot_charge_ms, rep.finishes)
    admission.sample(max(now, 0))
    return result


def _settle_unfinished(result: SimResult, done: int, charged: float, finishes: list[_Finish]) -> None:
    """Book what the requests still running at the run's end (``finishes``) were charged and generated, on a
    replica that ran ``done`` iterations and charged a slot ``charged`` ms over them."""
    output_tokens, tenant_index = result.workload.output_tokens, result.workload.tenant_index
    for last, i, charged_at_admit in finishes:
        result.request_gpu_ms[i] += charged - charged_at_admit
        generated = result.generated_tokens[i] = done - (last - output_tokens[i])
        result.tenant_decode_tokens[tenant_index[i]] += generated


_NEVER = 1 << 80  # later than any instant: a draining run's end is 2**62 ns


def _takes_charges(policy: Policy) -> bool:
    """Whether ``policy`` reads what is charged: first-come-first-served, round robin, the request quota and the
    slot cap do not (``QueuedPolicy.charge``), and are not called with each booking's."""
    return getattr(type(policy), "charge", None) is not QueuedPolicy.charge


def _run_one(
    admission: Admission, result: SimResult, start: _Start, settle: _Settle, duration_ns: int
) -> tuple[int, int, float, list[_Finish]]:
    """``_run_many`` for a lone replica (most runs), fused into one loop over local variables: the same
    instants, bookings and calls in the same order, without a call or an attribute look-up per step. A busy
    replica's instant is its own boundary, booked in one go; an idle one waits for an arrival or a wake-up.
    Returns the last instant, the iterations run, a slot's charge over them (ms) and the requests still running
    (their heap)."""
    position = {tenant: k for k, tenant in enumerate(admission.workload.tenants)}
    tenant_gpu_ms = result.tenant_gpu_ms
    max_batch, queued, sample = admission.cost.max_batch, admission.policy.queued, admission.sample
    charge_decode = admission.policy.charge_decode if _takes_charges(admission.policy) else None
    running: dict[str, int] = {}  # tenant -> running sequences
    finishes: list[_Finish] = []
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
                for tenant, n_running in running.items():
                    tenant_gpu_ms[position[tenant]] += k * n_running * per
                if charge_decode is not None:
                    charge_decode(running, k, per, size)
                charged += k * per
                done += k
                accounted_end = first + (k - 1) * dt
                decode_ns += k * dt
            if finishes and finishes[0][0] <= done:
                size -= settle(now, done, charged, running, finishes)
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
    result.busy_ns[0] += decode_ns  # integers: the same sum booked once
    result.iterations[0] = done  # every iteration is booked, and only here
    return now, done, charged, finishes


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
    workload: Workload, admission: Admission, result: SimResult, start: _Start, settle: _Settle, duration_ns: int
) -> tuple[_Step, _Step, Callable[[_Replica, int], None]]:
    """``_run_many``'s steps, as closures over the run's arrays: ``book(rep, upto, inclusive)``,
    ``boundary(rep, t, inclusive)`` (book, then settle the finishes due and start the next segment) and
    ``admit_and_start(rep, t)``."""
    position = {tenant: k for k, tenant in enumerate(workload.tenants)}
    tenant_gpu_ms, busy_ns, iterations = result.tenant_gpu_ms, result.busy_ns, result.iterations
    charge_decode = admission.policy.charge_decode if _takes_charges(admission.policy) else None

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
        per = rep.per_sequence_ms
        for tenant, running in rep.tenant_running.items():
            tenant_gpu_ms[position[tenant]] += k * running * per
        if charge_decode is not None:
            charge_decode(rep.tenant_running, k, per, rep.size)
        rep.slot_charge_ms += k * per
        rep.accounted_iterations += k
        rep.accounted_end = first + (k - 1) * dt
        busy_ns[rep.index] += k * dt
        iterations[rep.index] += k

    def boundary(rep: _Replica, t: int, inclusive: bool) -> None:
        book(rep, t, inclusive)
        rep.size -= settle(t, rep.accounted_iterations, rep.slot_charge_ms, rep.tenant_running, rep.finishes)
        assert not rep.finishes or rep.finishes[0][0] > rep.accounted_iterations, "a finish was skipped"
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

    return book, boundary, admit_and_start


def _settling(workload: Workload, admission: Admission, result: SimResult) -> _Settle:
    """``settle(t, done, charged, running, finishes)``: at the boundary ``t`` of a replica that ran ``done``
    iterations and charged a slot ``charged`` ms over them, settle every request whose last iteration that was
    (``finishes``: the replica's heap; ``running``: its sequences per tenant), in request id order as the
    reference's, and tell the policy (``Admission.finish``, written out). Returns the number settled."""
    request_gpu_ms, generated_tokens, finish_ns = result.request_gpu_ms, result.generated_tokens, result.finish_ns
    output_tokens, tenant_index, tenant_decode_tokens = (
        workload.output_tokens,
        workload.tenant_index,
        result.tenant_decode_tokens,
    )
    by_tenant, finish, all_requests = admission.admitter.view.by_tenant, admission.policy.finish, admission.requests
    heappop = heapq.heappop

    def settle(t: int, done: int, charged: float, running: dict[str, int], finishes: list[_Finish]) -> int:
        now_ms, count = t / NS_PER_MS, 0
        while finishes and finishes[0][0] == done:
            _, i, charged_at_admit = heappop(finishes)
            request_gpu_ms[i] += charged - charged_at_admit
            generated = generated_tokens[i] = output_tokens[i]  # it ran one iteration per token
            tenant_decode_tokens[tenant_index[i]] += generated
            request = all_requests[i]
            tenant = request.tenant
            left = running[tenant] - 1
            if left:
                running[tenant] = left
            else:
                del running[tenant]
            finish_ns[i] = t
            request.generated_tokens = generated  # its output length: it ran to its end
            by_tenant[tenant] -= request.sequences
            finish(request, now_ms)
            count += 1
        admission.finished += count
        admission.epoch += count
        return count

    return settle


def _starting(workload: Workload, cost: CostModel, admission: Admission, result: SimResult, duration_ns: int) -> _Start:
    """``start(index, t, size, done, charged, running, finishes)``: fill the free slots of replica ``index`` at
    ``t`` - ``size`` sequences running (``running``: per tenant; ``finishes``: their heap), ``done`` iterations
    and ``charged`` ms a slot booked - and start its next segment. Returns the segment: ``(size, dt,
    per_sequence_ms, head_end, epoch)``; ``size`` 0: the replica idles. Its admit step is ``Admitter.fill``, the
    gateway's dispatcher's too; the rest is written out: it runs at nearly every scheduling event."""
    tenant_index, output_tokens, arrival_ns = workload.tenant_index, workload.output_tokens, workload.arrival_ns
    tenant_gpu_ms, tenant_prefill_ms, admissions = result.tenant_gpu_ms, result.tenant_prefill_ms, result.admissions
    request_gpu_ms, admit_ns, first_token_ns = result.request_gpu_ms, result.admit_ns, result.first_token_ns
    all_requests, arrivals = admission.requests, len(workload)
    enqueue_all, fill = admission.policy.enqueue_all, admission.admitter.fill
    max_batch, busy_ns, heappush = cost.max_batch, result.busy_ns, heapq.heappush
    base_ns, prefill_ns_per_token = cost.decode_ns(0), cost.prefill_ns(1)
    slope_ns = cost.decode_ns(1) - base_ns

    def start(
        index: int, t: int, size: int, done: int, charged: float, running: dict[str, int], finishes: list[_Finish]
    ) -> tuple[int, int, float, int, int]:
        free, count, prefill_tokens, picked = max_batch - size, 0, 0, []
        if free > 0:
            now_ms, arrival = t / NS_PER_MS, admission.next_arrival_ns
            if arrival is not None and arrival <= t:  # ``Admission.deliver``, written out
                first = admission.delivered
                delivered = admission.delivered = bisect_right(arrival_ns, t, first)
                enqueue_all(all_requests[first:delivered], now_ms)
                admission.epoch += delivered - first
                admission.next_arrival_ns = arrival_ns[delivered] if delivered < arrivals else None
            for request, prefill_ms in fill(now_ms, free, size, cost):  # the admit step the gateway runs too
                count += 1
                i, tenant, prompt = request.request_id, request.tenant, request.prompt_tokens
                running[tenant] = running.get(tenant, 0) + 1
                k_tenant = tenant_index[i]
                tenant_gpu_ms[k_tenant] += prefill_ms  # ``book_admission``, written out
                tenant_prefill_ms[k_tenant] += prefill_ms
                request_gpu_ms[i] += prefill_ms
                admit_ns[i] = t
                admissions.append((i, index, t))
                prefill_tokens += prompt
                heappush(finishes, (done + output_tokens[i], i, charged))
                picked.append(i)
        if count:
            admission.admitted += count
            admission.epoch += count
            size += count
        elif size == 0:
            return 0, 0, 0.0, 0, admission.epoch
        dt = base_ns + slope_ns * size
        head_end = t + dt + prefill_ns_per_token * prefill_tokens
        busy_ns[index] += prefill_ns_per_token * prefill_tokens
        for i in picked:
            first_token_ns[i] = head_end
        return size, dt, dt / size / NS_PER_MS, head_end, admission.epoch

    return start
