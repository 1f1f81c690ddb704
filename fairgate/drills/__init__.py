"""Acceptance drills (seed 003, "During acceptance, simulate ..."): each starts a throwaway stack (emulated
replicas behind a real gateway with an SQLite ledger), drives it with the real ``openai`` client, and checks
one claim with measured figures.

``run_drill(name, options)`` runs one by name; ``fairgate drill NAME`` does the same from the command line
(exit 0 when the claim holds, 1 when it does not). Every drill returns a result with ``passed``, the
figures behind it, and ``render()`` / ``summary()`` for people.

Drills: ``burst`` (one tenant sends 20x its share; the others' p99 TTFT stays within 1.5x of their solo
baseline), ``ultra_long`` (an agent tenant's 8k-token outputs get no more than its GPU share),
``cancellation`` (1,000 streams cut at random points: every slot released, every reservation final, billed
tokens == tokens generated), ``retry`` (request ids re-sent up to 3x with jitter: not one double deduction),
``forged`` (every header, body and delegation trick: none billed to another tenant), ``outage`` (the ledger's
Redis stopped 30 s under load: reject tiers 503 + Retry-After, emergency tiers within budget, the journal
replayed and the ledger equal to what clients received), ``restart`` (a gateway process SIGKILLed with
requests queued and in flight: its reservations expire, nothing running is released, counts back to 0),
``scale_out`` (1, 2, 4 gateway processes on one PostgreSQL / Redis ledger admit nothing beyond the limits;
GPU shares stay fair when tenants' traffic lands on different processes), ``capacity`` (one of two replicas
killed mid-load: batch yields first, interactive tenants keep their weighted split, nothing lost).
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from importlib import import_module
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rich.console import RenderableType

    from fairgate.drills.loadgen import LoadReport, TenantLoad
    from fairgate.drills.stack import LedgerReport, StackSpec
    from fairgate.ledger import Reservation

SETTLE_S = 1.0  # after the clients hang up, time for the gateway to bill what was cancelled


@dataclass(frozen=True)
class DrillOptions:
    """What a caller may change in any drill.

    Attributes:
        seconds: length of each load phase (None: the drill's default).
        policy: the gateway's policy under test.
        compare: a second policy run on the same load for comparison (None: none). It does not change
            the verdict, which is about ``policy``.
        processes: run replicas and gateway as ``fairgate`` processes instead of threads of this process.
        seed: the load's random seed.
    """

    seconds: float | None = None
    policy: str = "gpu_fair"
    compare: str | None = "fcfs"
    processes: bool = False
    seed: int = 1


class DrillResult(Protocol):
    """What every drill returns."""

    name: str
    passed: bool

    def render(self) -> list[RenderableType]:
        """Tables and lines for a rich console."""

    def summary(self) -> str:
        """The same as plain text."""


class UnknownDrill(ValueError):
    """No drill by that name; the message lists the known ones."""


# name -> "module:function"; imported on use, so listing the drills costs nothing.
DRILLS: dict[str, str] = {
    "burst": "fairgate.drills.burst:run",
    "ultra_long": "fairgate.drills.ultra_long:run",
    "cancellation": "fairgate.drills.cancellation:run",
    "retry": "fairgate.drills.retry:run",
    "forged": "fairgate.drills.forged:run",
    "outage": "fairgate.drills.outage:run",
    "restart": "fairgate.drills.restart:run",
    "scale_out": "fairgate.drills.scale_out:run",
    "capacity": "fairgate.drills.capacity:run",
}

# What ``DrillOptions.compare`` runs for each drill that has a comparison ("{policy}": the compared policy);
# the others have none and ignore it.
COMPARISONS: dict[str, str] = {
    "burst": "{policy} for comparison",
    "ultra_long": "{policy} for comparison",
    "capacity": "{policy} for comparison",
    "scale_out": "the fairness run again without shared counters for comparison",
}


def describe_runs(name: str, policy: str, compare: str | None) -> str:
    """What ``run_drill(name, ...)`` will run, for people: ``"gpu_fair and fcfs for comparison"``."""
    comparison = COMPARISONS.get(name)
    if not compare or compare == policy or comparison is None:
        return policy
    return f"{policy} and {comparison.format(policy=compare)}"


def run_drill(name: str, options: DrillOptions | None = None) -> DrillResult:
    """Run the drill called ``name``. Raises ``UnknownDrill``."""
    target = DRILLS.get(name)
    if target is None:
        raise UnknownDrill(f"unknown drill {name!r}; choose one of {', '.join(DRILLS)}")
    module, _, function = target.partition(":")
    runner: Callable[[DrillOptions], DrillResult] = getattr(import_module(module), function)
    return runner(options or DrillOptions())


@dataclass(frozen=True)
class Run:
    """One load on a fresh stack: what the clients saw, and what the ledger holds.

    Attributes:
        policy: the gateway's policy.
        load: every request as its client saw it.
        ledger: each tenant's ledger totals at the end (after the hang-ups were billed).
        snapshots: the ledger totals at given seconds into the load (for shares over part of it).
        reservations: every reservation in the ledger at the end.
        tenants: the stack's tenants, in order.
    """

    policy: str
    load: LoadReport
    ledger: LedgerReport
    snapshots: dict[float, LedgerReport]
    reservations: tuple[Reservation, ...]
    tenants: tuple[str, ...]


def run_on_stack(
    spec: StackSpec, loads: Sequence[TenantLoad], seconds: float, seed: int, snapshot_at_s: Sequence[float] = ()
) -> Run:
    """Start ``spec``, send ``loads`` (each ``api_key`` is filled in from the stack) for ``seconds``, read the
    ledger at each of ``snapshot_at_s`` and, once the gateway has billed the hang-ups, at the end."""
    from fairgate.drills.loadgen import run_load
    from fairgate.drills.stack import read_ledger, read_reservations, start_stack

    with start_stack(spec) as stack:
        keyed = [replace(load, api_key=stack.keys[load.tenant]) for load in loads]

        async def snapshot(at_s: float, start: float) -> tuple[float, LedgerReport]:
            await asyncio.sleep(max(0.0, start + at_s - time.monotonic()))
            return at_s, await read_ledger(stack)

        async def go() -> Run:
            start = time.monotonic()
            snapshots = [asyncio.ensure_future(snapshot(at, start)) for at in snapshot_at_s]
            report = await run_load(stack.url, keyed, seconds, model=spec.model, seed=seed)
            taken = dict(await asyncio.gather(*snapshots))
            await asyncio.sleep(SETTLE_S)
            return Run(
                spec.policy,
                report,
                await read_ledger(stack),
                taken,
                tuple(await read_reservations(stack)),
                tuple(t.name for t in spec.tenants),
            )

        return asyncio.run(go())


def fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def fmt_errors(errors: dict[str, int]) -> str:
    """``{"429:insufficient_quota[max_model_calls]": 3}`` -> ``"429 max_model_calls x3"`` (``-`` for none)."""
    parts = []
    for code, count in errors.items():
        status, _, rest = code.partition(":")
        detail = rest.partition("[")[2].rstrip("]") or rest
        parts.append(f"{status} {detail} x{count}" if rest else f"{code} x{count}")
    return ", ".join(parts) or "-"


class RenderedResult(ABC):
    """Base of the drills' results: ``summary()`` is ``render()`` as plain text."""

    @abstractmethod
    def render(self) -> list[Any]:
        """Tables and lines for a rich console (each drill lays out its own figures)."""

    def summary(self) -> str:
        return plain_text(self.render())


class CheckedResult(RenderedResult):
    """A drill's result whose verdict is that every one of ``checks()`` holds."""

    @abstractmethod
    def checks(self) -> dict[str, bool]:
        """Each claim of the drill and whether it holds."""

    @property
    def passed(self) -> bool:
        return all(self.checks().values())

    def check_lines(self) -> list[str]:
        """One line per check, ``ok`` or ``FAIL`` and its claim (rich markup)."""
        return [
            f"  {'[green]ok[/green]  ' if ok else '[red]FAIL[/red]'} {check}" for check, ok in self.checks().items()
        ]


def plain_text(renderables: Sequence[Any], width: int = 140) -> str:
    """Render rich objects to plain text (for ``summary()``, logs and assertion messages)."""
    from rich.console import Console

    console = Console(width=width, record=True, file=_Discard(), color_system=None, highlight=False)
    for item in renderables:
        console.print(item)
    return console.export_text()


class _Discard:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


__all__ = [
    "DRILLS",
    "DrillOptions",
    "DrillResult",
    "Run",
    "UnknownDrill",
    "fmt_errors",
    "fmt_ms",
    "plain_text",
    "run_drill",
    "run_on_stack",
]
