"""``fairgate ledger ...``: operator commands on a quota ledger (reconcile, sweep, freeze, unfreeze, usage) and on
a gateway's emergency journal (journal)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

ledger_app = typer.Typer(no_args_is_help=True, help="Operate a quota ledger (sqlite:///…, postgresql://…, redis://…).")
console = Console(width=None if sys.stdout.isatty() else 140)
errors = Console(stderr=True)
T = TypeVar("T")

LedgerUrl = Annotated[
    str | None,
    typer.Option(
        "--ledger",
        help="Ledger URL: sqlite:///path.db, postgresql://…, "
        "redis://… (default: the ledger of a gateway config given as --quotas).",
    ),
]
QuotasPath = Annotated[str, typer.Option("--quotas", help="Quota TOML, or a gateway config (its \\[quotas]).")]


def _fail(message: str) -> typer.Exit:
    errors.print(f"error: {message}", markup=False, emoji=False, highlight=False, soft_wrap=True)
    return typer.Exit(2)


def _check_output(target: str | None) -> None:
    if target is None or target == "-":
        return
    from pathlib import Path

    path = Path(target)
    if not target.strip() or path.is_dir() or not path.parent.is_dir():
        raise _fail(f"--json {target}: not a writable file path (its folder must exist)")


def _quotas_of(path: str) -> Any:
    """A quota file, or a gateway configuration (its ``[quotas]`` section)."""
    from fairgate.ledger import QuotaConfigError, load_quotas, quotas_from_dict
    from fairgate.tomlfile import read_toml

    data = read_toml(path, QuotaConfigError, "quota file")
    if "gateway" in data and "quotas" in data:
        return quotas_from_dict(data["quotas"], f"{path} [quotas]")
    return load_quotas(path)


def _ledger_of(path: str) -> str:
    """The ledger URL of a gateway config (``[gateway].ledger``, an sqlite path made absolute)."""
    from fairgate.gateway.config import GatewayConfigError, load_gateway_config

    try:
        return load_gateway_config(path).ledger_url
    except GatewayConfigError as exc:
        raise _fail(f"--ledger not given, and --quotas is not a gateway config to take it from: {exc}") from None


def _run(work: Callable[[Any], Awaitable[T]], url: str | None, quotas: str) -> T:
    """Open an existing ledger, run ``work(ledger)``, close it; user errors -> one line, exit 2.

    Operator commands never create a ledger: a mistyped URL is an error, not a new empty ledger.
    """
    from fairgate.ledger import LedgerError, QuotaConfigError, connect
    from fairgate.ledger.reconcile import MeteredError

    if url is None:
        url = _ledger_of(quotas)

    async def go() -> T:
        ledger = await connect(url, _quotas_of(quotas), create=False)
        try:
            return await work(ledger)
        finally:
            await ledger.close()

    try:
        return asyncio.run(go())
    except (QuotaConfigError, MeteredError, LedgerError, ValueError) as exc:
        raise _fail(str(exc)) from None


@ledger_app.command()
def reconcile(
    quotas: QuotasPath,
    ledger: LedgerUrl = None,
    metered: Annotated[
        str | None, typer.Option(help="Metered usage CSV: tenant,input_tokens,output_tokens,gpu_ms.")
    ] = None,
    threshold: Annotated[float, typer.Option(min=0.0, max=1.0, help="Relative difference allowed vs metered.")] = 0.01,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Report only; freeze nobody.")] = False,
    json_out: Annotated[str | None, typer.Option("--json", help="Write the report as JSON to PATH or -.")] = None,
) -> None:
    """Compare reservations, the event log and a metered export; freeze and alert on differences.

    Exit code 0 when everything agrees, 1 when a difference was found, 2 on bad input.
    """
    from fairgate.ledger.reconcile import read_metered
    from fairgate.ledger.reconcile import reconcile as run_reconcile

    _check_output(json_out)

    async def work(opened: Any) -> Any:
        return await run_reconcile(opened, read_metered(metered) if metered else None, threshold, not dry_run)

    report = _run(work, ledger, quotas)
    table = Table(title="reconciliation", title_justify="left")
    for column in ("tenant", "billed in/out tokens", "billed GPU s", "open", "differences"):
        table.add_column(column)
    for t in report.tenants:
        table.add_row(
            escape(t.tenant),
            f"{t.events.input_tokens:,}/{t.events.output_tokens:,}",
            f"{t.events.gpu_ms / 1e3:,.1f}",
            str(t.open_reservations),
            escape("; ".join(t.differences) or "-"),
        )
    (errors if json_out == "-" else console).print(table)
    if json_out:
        text = json.dumps(report.to_json(), indent=2)
        if json_out == "-":
            sys.stdout.write(text + "\n")
        else:
            with open(json_out, "w") as handle:
                handle.write(text + "\n")
    if report.frozen:
        errors.print(f"froze automatic settlement for: {', '.join(report.frozen)}", markup=False, emoji=False)
    raise typer.Exit(0 if report.clean else 1)


@ledger_app.command()
def sweep(quotas: QuotasPath, ledger: LedgerUrl = None) -> None:
    """One expiry pass: extend reservations whose request still heartbeats, expire the others."""

    async def work(opened: Any) -> Any:
        return await opened.expire_due()

    expired = _run(work, ledger, quotas)
    console.print(f"expired {len(expired)} reservation(s)")


@ledger_app.command()
def unfreeze(tenant: Annotated[str, typer.Argument()], quotas: QuotasPath, ledger: LedgerUrl = None) -> None:
    """Resume automatic settlement for TENANT after review."""

    async def work(opened: Any) -> Any:
        opened.limits(tenant, "default")
        before = await opened.frozen()
        await opened.unfreeze(tenant)
        return before

    before = _run(work, ledger, quotas)
    console.print(f"{tenant}: " + ("unfrozen" if tenant in before else "was not frozen"), markup=False)


@ledger_app.command()
def usage(
    tenant: Annotated[str, typer.Argument()],
    quotas: QuotasPath,
    ledger: LedgerUrl = None,
    window_s: Annotated[float, typer.Option(min=1e-3, help="Window, seconds.")] = 86_400.0,
) -> None:
    """A tenant's billed usage over the last WINDOW_S seconds, as JSON."""
    from dataclasses import asdict

    async def work(opened: Any) -> Any:
        opened.limits(tenant, "default")  # UnknownTenant for a tenant the quotas do not know
        return await opened.usage(tenant, window_s)

    sys.stdout.write(json.dumps(asdict(_run(work, ledger, quotas)), indent=2) + "\n")


@ledger_app.command()
def journal(
    path: Annotated[str, typer.Argument(help="The gateway's emergency journal ([gateway] journal).")],
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
) -> None:
    """What a gateway's emergency journal holds: grants and settlements not yet replayed into the ledger,
    and grants parked because the ledger would not take them (their usage is not billed: review them).

    Exit code 0 when nothing is parked, 1 when something is, 2 on a bad file.
    """
    from pathlib import Path

    from fairgate.ledger.emergency import read_journal, read_parked

    journal_path = Path(path)
    if journal_path.is_dir():
        raise _fail(f"{path}: a directory, not a journal file")
    if not journal_path.parent.is_dir():  # a gateway cannot have written there: a wrong path, not a clean one
        raise _fail(f"{path}: no such directory {str(journal_path.parent)!r}")
    try:
        grants, pending = read_journal(journal_path)
        parked = read_parked(journal_path.with_suffix(".parked.jsonl"))
    except (OSError, ValueError) as exc:
        raise _fail(str(exc)) from None
    if json_out:
        sys.stdout.write(json.dumps({"grants": grants, "pending": pending, "parked": parked}, indent=2) + "\n")
        raise typer.Exit(1 if parked else 0)
    # A gateway writes its journal at its first emergency grant: none there yet is nothing pending, said so.
    absent = "" if journal_path.exists() else " (no such file yet: no grant was journalled, or the path is wrong)"
    title = f"journal {escape(path)}{absent}: {len(grants)} grant(s), {len(pending)} settlement(s) pending"
    table = Table(title=title)
    for column in ("kind", "tenant / request id", "usage in/out/GPU ms", "status or reason"):
        table.add_column(column)
    for record in [*grants, *parked]:
        usage = record.get("usage") or [0, 0, 0.0]
        table.add_row(
            "parked" if record["type"] == "parked" else "grant",
            escape(f"{record.get('tenant')}/{record.get('request_id')}"),
            f"{usage[0]}/{usage[1]}/{float(usage[2]):.1f}",
            escape(str(record.get("reason") or record.get("status"))),
        )
    for record in pending:
        usage = record.get("usage") or [0, 0, 0.0]
        table.add_row(
            "pending",
            escape(str(record.get("id"))),
            f"{usage[0]}/{usage[1]}/{float(usage[2]):.1f}",
            str(record.get("kind")),
        )
    console.print(table)
    raise typer.Exit(1 if parked else 0)
