"""Reconciliation: reservations, the usage event log and (when given) a metered-usage export, compared.

Seed 003: "Daily reconciliation compares gateway reservations, actual tokens from the model service, GPU
metering, and billing events; when differences exceed a threshold, freeze auto-settlement and alert,
instead of silently modifying the user balance." Nothing here edits a balance: a tenant with a
difference is frozen (``Ledger.freeze``), an alert is logged (JSON line on the ``fairgate.alerts`` logger)
and counted (``fairgate_reconciliation_alerts_total``), and the report says what differs.

Metered export: CSV with the header ``tenant,input_tokens,output_tokens,gpu_ms`` (one row per tenant, the
usage the model service measured over the same period). A tenant the ledger billed and the export leaves out is
compared as metered 0 - the model service saw none of its usage - and its difference says so: an export that
leaves a tenant out is what reconciliation is there to catch (usage billed that no engine ran).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prometheus_client import Counter

from fairgate.ledger import rules
from fairgate.ledger.base import Ledger, tenant_tag
from fairgate.ledger.model import Reservation, Usage

ALERTS = Counter(
    "fairgate_reconciliation_alerts", "Reconciliation differences over the threshold", ["tenant_hash", "kind"]
)
log = logging.getLogger("fairgate.alerts")


class MeteredError(ValueError):
    """A bad metered-usage export; ``str()`` names the file and line."""


# Token and GPU-ms totals of one view of a tenant's usage (the same three numbers as a settlement's).
Totals = Usage


@dataclass
class TenantReconciliation:
    """One tenant's three views of its usage, and the differences found.

    ``input_above_reservation`` flags the reservations billed more input than ``rules.input_allowance`` of
    what they reserved (the engine read far more than the gateway estimated; billed as read): their count and
    the first ``FLAGGED_LISTED_MAX`` request ids. A flag is no difference: the views still agree.
    """

    tenant: str
    reservations: Totals
    events: Totals
    metered: Totals | None
    open_reservations: int
    differences: list[str] = field(default_factory=list)
    input_above_reservation: dict[str, object] = field(default_factory=dict)


@dataclass
class ReconcileReport:
    """Every tenant's reconciliation, and the tenants frozen by this run."""

    tenants: list[TenantReconciliation]
    frozen: list[str]

    @property
    def clean(self) -> bool:
        """No tenant has a difference."""
        return not any(t.differences for t in self.tenants)

    def to_json(self) -> dict[str, object]:
        """The report as JSON-ready data (``fairgate ledger reconcile --json``, the admin API)."""
        return {"clean": self.clean, "frozen": self.frozen, "tenants": [asdict(t) for t in self.tenants]}


FLAGGED_LISTED_MAX = 20
_INTEGER = re.compile(r"^[0-9]+$")
_NUMBER = re.compile(r"^[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?$")
METERED_COLUMNS = ("tenant", "input_tokens", "output_tokens", "gpu_ms")


def read_metered(path: str | Path) -> dict[str, Totals]:
    """Read a metered-usage export (module docstring). Raises ``MeteredError`` naming the file and line."""
    path = Path(path)
    if path.exists() and not path.is_dir() and not path.is_file():
        raise MeteredError(f"{path}: not a regular file")
    if path.is_file() and path.stat().st_size > 100 * 1024 * 1024:
        raise MeteredError(f"{path}: larger than 100 MiB")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise MeteredError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise MeteredError(f"{path}: not UTF-8 text") from None
    rows = csv.reader(text.splitlines())
    header = next(rows, None)
    if header != list(METERED_COLUMNS):
        raise MeteredError(f"{path}: expected the header {','.join(METERED_COLUMNS)} (has: {','.join(header or [])})")
    out: dict[str, Totals] = {}
    for line, row in enumerate(rows, start=2):
        if len(row) != len(METERED_COLUMNS):
            raise MeteredError(f"{path}: line {line}: expected {len(METERED_COLUMNS)} fields, got {len(row)}")
        tenant, input_tokens, output_tokens, gpu_ms = row
        if not tenant:
            raise MeteredError(f"{path}: line {line}: empty tenant")
        if not _INTEGER.match(input_tokens) or not _INTEGER.match(output_tokens):
            raise MeteredError(f"{path}: line {line}: token counts must be whole numbers >= 0")
        if not _NUMBER.match(gpu_ms) or not math.isfinite(float(gpu_ms)):
            raise MeteredError(f"{path}: line {line}: gpu_ms must be a finite number >= 0, got {gpu_ms!r:.40}")
        if tenant in out:
            raise MeteredError(f"{path}: line {line}: tenant {tenant!r} appears twice")
        out[tenant] = Totals(int(input_tokens), int(output_tokens), float(gpu_ms))
    return out


def _input_above_reservation(reservations: list[Reservation]) -> dict[str, object]:
    """The flag of ``TenantReconciliation.input_above_reservation`` over one tenant's ``reservations``."""
    flagged = [r.request_id for r in reservations if r.billed.input_tokens > rules.input_allowance(r.input_tokens)]
    return {"count": len(flagged), "request_ids": flagged[:FLAGGED_LISTED_MAX]}


def _differs(a: float, b: float, threshold: float) -> bool:
    return abs(a - b) > threshold * max(abs(a), abs(b), 1.0)


async def reconcile(
    ledger: Ledger, metered: dict[str, Totals] | None = None, threshold: float = 0.01, freeze: bool = True
) -> ReconcileReport:
    """Compare the views per tenant; freeze and alert where they differ by more than ``threshold``.

    Reservations and events must agree exactly (both are the ledger's own records); the metered export
    may differ by ``threshold`` (relative, per dimension) before it counts.
    """
    unknown = sorted(set(metered or {}) - set(ledger.quotas.tenants))
    if unknown:
        raise MeteredError(f"the metered export names tenants with no quota configuration: {', '.join(unknown)}")
    reservations = await ledger.reservations()
    events = await ledger.events()
    tenants = sorted({r.tenant for r in reservations} | set(metered or {}))
    report = ReconcileReport([], [])
    for tenant in tenants:
        mine = [r for r in reservations if r.tenant == tenant]
        booked = Totals(
            sum(r.billed.input_tokens for r in mine),
            sum(r.billed.output_tokens for r in mine),
            sum(r.billed.gpu_ms for r in mine),
        )
        logged = [e for e in events if e.tenant == tenant]
        logged_totals = Totals(
            sum(e.input_tokens for e in logged), sum(e.output_tokens for e in logged), sum(e.gpu_ms for e in logged)
        )
        row = TenantReconciliation(
            tenant,
            booked,
            logged_totals,
            (metered or {}).get(tenant) if metered else None,
            sum(1 for r in mine if r.status == "open"),
            input_above_reservation=_input_above_reservation(mine),
        )
        for name in ("input_tokens", "output_tokens", "gpu_ms"):
            a, b = getattr(booked, name), getattr(logged_totals, name)
            if _differs(a, b, 1e-9):
                row.differences.append(f"{name}: reservations {a:g} != event log {b:g}")
            if metered is not None:
                m = getattr(row.metered or Totals(), name)
                if _differs(b, m, threshold):
                    absent = "" if row.metered is not None else ", the tenant not in the export"
                    row.differences.append(f"{name}: event log {b:g} vs metered {m:g}{absent} (over {threshold:.1%})")
        if row.differences:
            kind = "metered" if any("metered" in d for d in row.differences) else "ledger"
            ALERTS.labels(tenant_tag(tenant), kind).inc()
            log.warning(
                json.dumps(
                    {"alert": "reconciliation", "tenant_hash": tenant_tag(tenant), "differences": row.differences}
                )
            )
            if freeze:
                await ledger.freeze(tenant, "; ".join(row.differences))
                report.frozen.append(tenant)
        report.tenants.append(row)
    return report
