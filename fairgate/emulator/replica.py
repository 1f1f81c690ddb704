"""Continuous batching on a real clock: the iteration loop of one emulated replica.

Conventions as in ``shared/DESIGN.md`` (and the simulator): requests are admitted at iteration boundaries,
first come first served, up to ``max_batch`` running; an idle replica starts an iteration as soon as a
request arrives; a new sequence is prefilled in the iteration it joins and emits its first token at that
iteration's end; each iteration lasts ``dt = iter_base + iter_slope * B + prefill_ms_per_token * prompt
tokens admitted``. Iterations are scheduled against absolute deadlines (``start + dt``), so event-loop
jitter does not accumulate. A cancelled sequence leaves at the next boundary: it stops within one
iteration and frees its slot.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from fairgate.core.cost import CostModel


@dataclass
class Sequence:
    """One request on the replica. ``events`` yields the index of each generated token, then ``None``."""

    prompt_tokens: int
    output_tokens: int  # tokens it will generate if not cancelled
    arrival_s: float
    generated: int = 0
    cancelled: bool = False
    finished: bool = False
    first_token_s: float | None = None
    events: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    cache_salt: str | None = None  # the tenant scope the gateway sent (vLLM's cache_salt)
    charged_ms: float = 0.0  # GPU ms by seed 002's charge rule over the iterations it ran in


@dataclass(frozen=True)
class Iteration:
    """One iteration: planned start (s, monotonic clock), planned length and measured length (ms: from the
    previous iteration's end, or from the start after idle), batch size and prompt tokens prefilled."""

    start_s: float
    planned_ms: float
    measured_ms: float
    batch: int
    prefill_tokens: int


class EmulatedReplica:
    """The iteration loop. ``start()`` runs it as a task on the current event loop.

    Args:
        cost: iteration-time model (ms) and ``max_batch``.
        clock: monotonic seconds (default ``time.monotonic``).
        keep_iterations: how many recent iterations ``iterations`` keeps (for tests and stats).
    """

    def __init__(
        self, cost: CostModel, clock: Callable[[], float] = time.monotonic, keep_iterations: int = 10_000
    ) -> None:
        self.cost = cost
        self._clock = clock
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.iterations: deque[Iteration] = deque(maxlen=keep_iterations)
        self.busy_ms = 0.0
        # Ground truth for the gateway's live meter: the charge rule applied to the real iterations, per
        # cache_salt (the gateway's tenant hash); "" for requests sent without one.
        self.charged_ms_by_salt: dict[str, float] = {}
        self.tokens_generated = 0
        self.sequences_finished = 0
        self.sequences_cancelled = 0

    # --- control ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="emulated-replica")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def submit(self, prompt_tokens: int, output_tokens: int, cache_salt: str | None = None) -> Sequence:
        """Queue a request; it is admitted at the next boundary with a free slot.

        Raises:
            ValueError: ``output_tokens`` < 1 or ``prompt_tokens`` < 0.
        """
        if output_tokens < 1 or prompt_tokens < 0:
            raise ValueError("a sequence needs prompt_tokens >= 0 and output_tokens >= 1")
        seq = Sequence(prompt_tokens, output_tokens, self._clock(), cache_salt=cache_salt)
        self._waiting.append(seq)
        self._wakeup.set()
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Stop ``seq``: it generates nothing more and leaves its slot at the next boundary."""
        if not seq.finished and not seq.cancelled:
            seq.cancelled = True
            seq.events.put_nowait(None)

    # --- state ----------------------------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return sum(1 for s in self._waiting if not s.cancelled)

    # --- the loop ---------------------------------------------------------------------------------
    async def _loop(self) -> None:
        start = self._clock()
        previous_end: float | None = None  # end of the previous iteration, if this one follows it directly
        while True:
            if not self._running and not self._waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
                start = self._clock()  # an idle replica starts at the arrival instant
                previous_end = None
            prefill_tokens = 0
            admitted: list[Sequence] = []
            while self._waiting and len(self._running) < self.cost.max_batch:
                seq = self._waiting.popleft()
                if seq.cancelled:
                    continue
                self._running.append(seq)
                admitted.append(seq)
                prefill_tokens += seq.prompt_tokens
            batch = len(self._running)
            if batch == 0:
                continue
            planned_ms = self.cost.iteration_ms(batch, prefill_tokens)
            deadline = start + planned_ms / 1000.0
            # Always yield to the event loop, even when late: the HTTP side runs on the same loop.
            await asyncio.sleep(max(0.0, deadline - self._clock()))
            end = self._clock()
            # Measured from the previous iteration's end (tokens are seen at iteration ends), so a late
            # wake-up shows once and is made up by the next, shorter wait.
            began = previous_end if previous_end is not None else start
            self.iterations.append(Iteration(start, planned_ms, (end - began) * 1000.0, batch, prefill_tokens))
            # Late by more than an iteration (a stalled loop): restart the schedule from now.
            start = deadline if end - deadline < planned_ms / 1000.0 else end
            previous_end = end
            self.busy_ms += planned_ms
            decode_share_ms = self.cost.decode_ms(batch) / batch
            new = {id(seq) for seq in admitted}
            for seq in self._running:
                charge = decode_share_ms + (self.cost.prefill_ms(seq.prompt_tokens) if id(seq) in new else 0.0)
                seq.charged_ms += charge
                salt = seq.cache_salt or ""
                self.charged_ms_by_salt[salt] = self.charged_ms_by_salt.get(salt, 0.0) + charge
            still: list[Sequence] = []
            for seq in self._running:
                if seq.cancelled:
                    self.sequences_cancelled += 1
                    continue
                seq.generated += 1
                self.tokens_generated += 1
                if seq.first_token_s is None:
                    seq.first_token_s = end
                seq.events.put_nowait(seq.generated)
                if seq.generated >= seq.output_tokens:
                    seq.finished = True
                    seq.events.put_nowait(None)
                    self.sequences_finished += 1
                else:
                    still.append(seq)
            self._running = still
