"""N gateway processes' meters on one replica, sharing occupancy in rounds (``fairgate.gateway.sharing``).

A replica runs continuous batching under the charge rule; each process holds one slot and keeps it busy
with short requests (closed loop, 16-token prompts, 8-16 output tokens, as the scale_out drill sends), reads
every token a little late, and every ``share_ms`` (each process at its own phase) publishes its averaged
occupancy and sets the sum of the others' latest on its meter. Nothing here reads a clock: the figures are
exact and the same on every machine.

What it pins: in steady state the processes together bill the replica's busy time to within 1 %; when a
load starts, each process bills as if alone until the rounds tell it otherwise, a fixed excess of less than
``(N - 1) * share_ms`` that does not grow with the load's length (so the scale_out drill's billed / busy
claim needs a load long against the rounds: tests/drills/test_scale_out.py, LIMITS_LOAD_S).
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field

import pytest

from fairgate.core import CostModel
from fairgate.core.meter import LiveMeter, Occupancy

COST = CostModel(25.0, 0.5, 0.02, 64)  # the scale_out drill's replica


@dataclass
class _Run:
    """One simulated run's state: the event heap, the meters, the replica's batch."""

    processes: int
    rng: random.Random
    meters: list[LiveMeter]
    published: list[Occupancy]
    events: list[tuple[float, int, str, tuple]] = field(default_factory=list)
    running: dict[str, list[int]] = field(default_factory=dict)  # request -> [tokens left, process, first]
    joining: list[tuple[str, list[int], int]] = field(default_factory=list)
    iteration_running: bool = False
    busy_ms: float = 0.0
    busy_since_ms: float = 0.0
    sent: int = 0
    order: itertools.count[int] = field(default_factory=itertools.count)  # ties: first pushed first

    def push(self, at_ms: float, kind: str, data: tuple) -> None:
        heapq.heappush(self.events, (at_ms, next(self.order), kind, data))

    def send(self, at_ms: float, process: int) -> None:
        self.sent += 1
        self.push(at_ms, "start", (process, f"r{self.sent}", 16, self.rng.randint(8, 16)))

    def start_iteration(self, now_ms: float) -> None:
        prefill_ms = sum(COST.prefill_ms(prompt) for _, _, prompt in self.joining)
        self.running.update({name: state for name, state, _ in self.joining})
        self.joining.clear()
        self.iteration_running = True
        self.push(now_ms + COST.decode_ms(len(self.running)) + prefill_ms, "iteration", ())


def _handle(run: _Run, now_ms: float, kind: str, data: tuple, end_ms: float, share_ms: float) -> None:
    if kind == "start":
        process, name, prompt, output = data
        if now_ms > end_ms:
            return
        run.meters[process].start(name, "t", prompt, now_ms)
        run.joining.append((name, [output, process, 1], prompt))
        if not run.iteration_running:
            run.busy_since_ms = now_ms
            run.start_iteration(now_ms)
    elif kind == "iteration":
        for name, state in list(run.running.items()):
            state[0] -= 1
            run.push(now_ms + run.rng.uniform(0.0, 3.0), "token", (state[1], name, state[2], state[0] == 0))
            state[2] = 0
            if state[0] == 0:
                del run.running[name]
        if run.running or run.joining:
            run.start_iteration(now_ms)
        else:
            run.iteration_running = False
            run.busy_ms += now_ms - run.busy_since_ms
    elif kind == "token":
        process, name, first, last = data
        meter = run.meters[process]
        meter.first_token(name, now_ms) if first else meter.token(now_ms)
        if last:
            meter.finish(name, now_ms)
            run.send(now_ms + run.rng.uniform(0.0, 20.0), process)
    elif kind == "share":
        (process,) = data
        meter = run.meters[process]
        meter.advance(now_ms)
        run.published[process] = meter.take_occupancy()
        others = [o for p, o in enumerate(run.published) if p != process]
        meter.set_remote(
            Occupancy(sum(o.sequences for o in others), min(1.0, sum(o.prefill_share for o in others))), now_ms
        )
        if now_ms < end_ms + 5000.0:
            run.push(now_ms + share_ms, "share", (process,))


def _billed_and_busy(processes: int, seconds: float, share_ms: float, seed: int) -> tuple[float, float]:
    """(GPU ms the processes billed together, the replica's busy ms) for one run."""
    rng = random.Random(seed)
    run = _Run(processes, rng, [LiveMeter(COST, 0.0) for _ in range(processes)], [Occupancy()] * processes)
    for process in range(processes):
        run.send(rng.uniform(0.0, 20.0), process)
        run.push(rng.uniform(0.0, share_ms), "share", (process,))
    while run.events:
        now_ms, _, kind, data = heapq.heappop(run.events)
        _handle(run, now_ms, kind, data, seconds * 1000.0, share_ms)
    assert not run.running and all(m.in_flight == 0 for m in run.meters)
    return sum(m.charged_total_ms for m in run.meters), run.busy_ms


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_processes_sharing_a_replica_bill_its_busy_time_once_in_steady_state(seed: int) -> None:
    billed, busy = _billed_and_busy(4, 60.0, 250.0, seed)
    assert busy > 50_000.0
    assert billed / busy == pytest.approx(1.0, abs=0.01)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_load_starting_is_over_billed_by_less_than_a_round_per_other_process(seed: int) -> None:
    """The excess comes from the start (each process alone until the rounds tell it otherwise): under
    (N - 1) rounds' worth after 8 s and after 60 s alike, so it is a fixed amount, not a rate."""
    processes, share_ms = 4, 250.0
    for seconds in (8.0, 60.0):
        billed, busy = _billed_and_busy(processes, seconds, share_ms, seed)
        assert 0.0 < billed - busy < (processes - 1) * share_ms, (seconds, billed, busy)
    # With rounds four times as far apart the start costs about four times as much.
    billed, busy = _billed_and_busy(processes, 8.0, 4 * share_ms, seed)
    assert (processes - 1) * share_ms < billed - busy < (processes - 1) * 4 * share_ms
