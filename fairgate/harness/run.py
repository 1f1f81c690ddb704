"""One load on a fresh stack, for a claim about what the ledger billed during a load (the ``burst`` and
``ultra_long`` drills, the live fairness bench): ``run_on_stack`` starts the stack, sends the loads, reads
the ledger at given seconds and, once the gateway has billed the hang-ups, at the end."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fairgate.harness.history import HistoryReport, check_stack
from fairgate.harness.ledger import LedgerReport
from fairgate.harness.loadgen import LoadGenerator, TenantLoad
from fairgate.harness.records import History
from fairgate.harness.stack import StackSpec, start_stack

if TYPE_CHECKING:
    from fairgate.ledger import Reservation

SETTLE_S = 1.0  # after the clients hang up, time for the gateway to bill what was cancelled


@dataclass(frozen=True)
class Run:
    """One load on a fresh stack: what the clients saw, and what the ledger holds."""

    policy: str  # the gateway's policy
    history: History  # every request as its client saw it
    ledger: LedgerReport  # each tenant's ledger totals at the end (after the hang-ups were billed)
    snapshots: dict[float, LedgerReport]  # the ledger totals at given seconds into the load (shares over part of it)
    reservations: tuple[Reservation, ...]  # every reservation in the ledger at the end
    history_check: HistoryReport | None = None  # the history checker's report (None: not asked for)


async def until(generator: LoadGenerator, at_s: float) -> None:
    """Sleep until ``at_s`` seconds after ``generator`` started."""
    await asyncio.sleep(max(0.0, at_s - generator.now()))


async def poll(
    ready: Callable[[], Awaitable[bool]], deadline_s: float, now: Callable[[], float], every_s: float = 0.1
) -> float | None:
    """Await ``ready()`` every ``every_s`` until it is true: ``now()`` then (None: still not after ``deadline_s``)."""
    while not await ready():
        if now() > deadline_s:
            return None
        await asyncio.sleep(every_s)
    return now()


def run_on_stack(
    spec: StackSpec,
    loads: Sequence[TenantLoad],
    seconds: float,
    seed: int,
    snapshot_at_s: Sequence[float] = (),
    check: bool = False,
) -> Run:
    """Start ``spec``, send ``loads`` for ``seconds``, read the ledger at each of ``snapshot_at_s`` and, once
    the gateway has billed the hang-ups, at the end; ``check``: then run the history checker on every request
    (``fairgate.harness.history.check_stack``, default bounds: the load's end hangs up on those running)."""
    with start_stack(spec) as stack:

        async def go() -> Run:
            async with LoadGenerator(stack.url, stack.keys, spec.model, seed) as generator:

                async def snapshot(at_s: float) -> tuple[float, LedgerReport]:
                    await until(generator, at_s)
                    return at_s, await stack.totals()

                snapshots = [asyncio.ensure_future(snapshot(at)) for at in snapshot_at_s]
                history = await generator.run(loads, seconds)
                taken = dict(await asyncio.gather(*snapshots))
            await asyncio.sleep(SETTLE_S)
            report = await check_stack(stack, history.records) if check else None
            totals, reservations = await stack.totals(), tuple(await stack.reservations())
            return Run(spec.policy, history, totals, taken, reservations, report)

        return asyncio.run(go())


__all__ = ["Run", "poll", "run_on_stack", "until"]
