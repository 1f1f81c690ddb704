"""``fairgate drill NAME``: run an acceptance drill (``fairgate.drills``) and print its figures.

Exit codes: 0 the claim holds, 1 it does not, 2 a usage error (unknown drill or policy, bad option, the
``openai`` client missing).
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console

drill_app = typer.Typer()  # its one command, ``drill``, joins the main app (fairgate.cli.main)
_WIDTH = None if sys.stdout.isatty() else 140
console = Console(width=_WIDTH)
errors = Console(stderr=True, width=_WIDTH)


def _fail(message: str) -> typer.Exit:
    errors.print(f"error: {message}", markup=False, emoji=False, highlight=False, soft_wrap=True)
    return typer.Exit(code=2)


@drill_app.command("drill")
def drill(
    name: Annotated[
        str,
        typer.Argument(
            help="The drill: burst, ultra_long, cancellation, retry, forged, ... (an unknown name lists them all)."
        ),
    ],
    seconds: Annotated[
        float | None, typer.Option(min=5.0, max=600.0, help="Length of each load phase (default: the drill's).")
    ] = None,
    policy: Annotated[str, typer.Option("--policy", "-p", help="The gateway policy under test.")] = "gpu_fair",
    compare: Annotated[str, typer.Option(help="A second policy run for comparison, or none.")] = "fcfs",
    processes: Annotated[
        bool | None,
        typer.Option(
            "--processes/--no-processes",
            help="Run replicas and gateway as fairgate processes, or on threads of this one (default: the drill's).",
        ),
    ] = None,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the load's randomness.")] = 1,
) -> None:
    """Run an acceptance drill on loopback (emulated replicas, the gateway, a ledger: SQLite, or the
    PostgreSQL / Redis on 127.0.0.1 for outage, restart and scale_out - $FAIRGATE_DRILL_LEDGERS names others
    for scale_out); exit 0 if its claim holds. docs/drills.md lists each drill's claim, load and time."""
    from fairgate.core.policies.factory import POLICY_NAMES
    from fairgate.drills import DRILLS, DrillOptions, UnknownDrill, describe_runs, run_drill

    if name not in DRILLS:
        raise _fail(f"unknown drill {name!r}; choose one of {', '.join(DRILLS)}")
    comparison = None if compare.strip().lower() in ("", "none") else compare.strip()
    for option, value in (("--policy", policy), ("--compare", comparison)):
        if value is not None and value not in POLICY_NAMES:
            raise _fail(f"{option} {value!r}: unknown policy; choose one of {', '.join(POLICY_NAMES)}")
    try:
        import openai  # noqa: F401 - the drills' load generator drives the real client
    except ModuleNotFoundError:
        raise _fail("the drills need the openai package: pip install 'openai>=1.30'") from None
    errors.print(
        f"drill {name}: running under {describe_runs(name, policy, comparison)} ...", markup=False, highlight=False
    )
    try:
        result = run_drill(
            name, DrillOptions(seconds=seconds, policy=policy, compare=comparison, processes=processes, seed=seed)
        )
    except UnknownDrill as exc:  # pragma: no cover - checked above
        raise _fail(str(exc)) from None
    except ValueError as exc:
        raise _fail(str(exc)) from None
    for item in result.render():
        console.print(item)
    raise typer.Exit(code=0 if result.passed else 1)
