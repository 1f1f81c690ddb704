"""Acceptance drills (seed 003, "During acceptance, simulate ..."): each starts a throwaway stack on loopback
(``fairgate.harness``: emulated replicas, real gateways, a real ledger), drives it with the real ``openai``
client, injects its fault and checks one claim with measured figures. ``run_drill(name, options)`` runs one
by name; ``fairgate drill NAME`` does the same from the command line (exit 0 when the claim holds, 1 when it
does not). docs/drills.md lists each drill's claim, load, fault and figures.

How a new drill is written (``ultra_long.py`` is the small example to copy):

1. ``fairgate/drills/NAME.py`` starts with the claim in its docstring, then a frozen ``NAMEConfig`` dataclass:
   the setting, its defaults the acceptance scenario; ``spec()`` returns the ``StackSpec`` to start and
   ``loads()`` the ``TenantLoad`` of each tenant (``fairgate.harness.stack`` / ``fairgate.harness.loadgen``).
2. ``run(options: DrillOptions, config=None)`` runs it (``options.setting(config)`` applies ``--seconds``):
   ``run_on_stack`` (``fairgate.harness.run``) for a load with ledger readings, or ``start_stack`` +
   ``LoadGenerator`` when the drill injects a fault on its own timeline (``Stack.ledger()`` to read the
   ledger, ``poll`` to wait for convergence); it sums up what clients, ledger and replicas saw in frozen
   figures dataclasses.
3. Its result derives ``DrillResult`` (``fairgate.drills.report``; ``ConfiguredResult`` holds the config and
   the figures, ``ComparedResult`` a comparison run beside them, run by ``main_and_compare``, each shown by
   ``policy_table``) and says only what is its own: ``checks()`` (each part of the claim), ``intro()``,
   ``body()`` (tables, with ``table``; ``grouped`` for rows by a key) and ``verdict()``.
4. It joins ``DRILLS`` below (and ``COMPARISONS`` if it runs a comparison policy), gets a serial test in
   ``tests/drills/test_NAME.py`` asserting the claim within a wall-time bound, and a row in docs/drills.md.

A drill imports the harness, the drills' base (this package and ``report``) and the gateway, ledger and
emulator; never another drill.

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

from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import import_module
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from fairgate.drills.report import DrillResult

C = TypeVar("C")


@dataclass(frozen=True)
class DrillOptions:
    """What a caller may change in any drill."""

    seconds: float | None = None  # length of each load phase (None: the drill's default)
    policy: str = "gpu_fair"  # the gateway's policy under test
    # a second policy run on the same load for comparison (None: none). It does not change the verdict,
    # which is about ``policy``.
    compare: str | None = "fcfs"
    # run replicas and gateway as ``fairgate`` processes instead of threads of this process (None: the drill's
    # choice, ``in_processes``)
    processes: bool | None = None
    seed: int = 1  # the load's random seed

    def setting(self, config: C, name: str = "seconds") -> C:
        """``config`` with its field ``name`` set to ``seconds``, if given (a drill's length setting)."""
        return config if self.seconds is None else replace(config, **{name: self.seconds})  # type: ignore[type-var]

    def in_processes(self, default: bool) -> bool:
        """``processes``, or the drill's ``default`` when it is None. Drills whose load is hundreds of streams
        default to processes: on threads of one interpreter the load generator, the gateway and the replicas
        share its lock, and on a slow two-core machine the drill measures that lock (the burst drill's others'
        p99 TTFT went x6 on threads, x1.24 as processes, same machine and load)."""
        return default if self.processes is None else self.processes

    @property
    def comparison(self) -> str | None:
        """The policy to compare with: ``compare``, unless it is None, empty or ``policy`` itself."""
        return self.compare if self.compare and self.compare != self.policy else None


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
    comparison, compared = COMPARISONS.get(name), DrillOptions(policy=policy, compare=compare).comparison
    if compared is None or comparison is None:
        return policy
    return f"{policy} and {comparison.format(policy=compared)}"


def run_drill(name: str, options: DrillOptions | None = None) -> DrillResult:
    """Run the drill called ``name``. Raises ``UnknownDrill``."""
    target = DRILLS.get(name)
    if target is None:
        raise UnknownDrill(f"unknown drill {name!r}; choose one of {', '.join(DRILLS)}")
    module, _, function = target.partition(":")
    runner: Callable[[DrillOptions], DrillResult] = getattr(import_module(module), function)
    return runner(options or DrillOptions())


__all__ = ["COMPARISONS", "DRILLS", "DrillOptions", "UnknownDrill", "describe_runs", "run_drill"]
