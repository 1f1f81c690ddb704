"""Reconciliation: reservations, the usage event log and (when given) a metered-usage export, compared.

Seed 003: "Daily reconciliation compares gateway reservations, actual tokens from the model service, GPU
metering, and billing events; when differences exceed a threshold, freeze auto-settlement and alert,
instead of silently modifying the user balance." Nothing here edits a balance: a tenant with a
difference is frozen (``Ledger.freeze``), an alert is logged (JSON line on the ``fairgate.alerts`` logger)
and counted (``fairgate_reconciliation_alerts_total``), and the report says what differs.

Metered export: CSV with the header ``tenant,input_tokens,output_tokens,gpu_ms`` (one row per tenant, the
usage the model service measured over the same period).
"""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prometheus_client import Counter

from fairgate.ledger.base import Ledger, tenant_tag

ALERTS = Counter("fairgate_reconciliation_alerts", "Reconciliation differences over the threshold",
                 ["tenant_hash", "kind"])
log = logging.getLogger("fairgate.alerts")


class MeteredError(ValueError):
    """A bad metered-usage export; ``str()`` names the file and line."""


@dataclass(frozen=True)
class Totals:
    input_tokens: int = 0
    output_tokens: int = 0
    gpu_ms: float = 0.0


@dataclass
class TenantReconciliation:
    """One tenant's three views of its usage, and the differences found."""

    tenant: str
    reservations: Totals
    events: Totals
    metered: Totals | None
    open_reservations: int
    differences: list[str] = field(default_factory=list)


@dataclass
class ReconcileReport:
    tenants: list[TenantReconciliation]
    frozen: list[str]

    @property
    def clean(self) -> bool:
        return not any(t.differences for t in self.tenants)

    def to_json(self) -> dict[str, object]:
        return {"clean": self.clean, "frozen": self.frozen, "tenants": [asdict(t) for t in self.tenants]}


def read_metered(path: str | Path) -> dict[str, Totals]:
    """Read a metered-usage export (module docstring). Raises ``MeteredError`` naming the file and line."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise MeteredError(f"{path}: cannot read: {exc.strerror or exc}") from None
    rows = csv.DictReader(text.splitlines())
    needed = ("tenant", "input_tokens", "output_tokens", "gpu_ms")
    if rows.fieldnames is None or any(c not in rows.fieldnames for c in needed):
        raise MeteredError(f"{path}: expected the header {','.join(needed)} (has: {rows.fieldnames})")
    out: dict[str, Totals] = {}
    for line, row in enumerate(rows, start=2):
        try:
            totals = Totals(int(row["input_tokens"]), int(row["output_tokens"]), float(row["gpu_ms"]))
        except (TypeError, ValueError):
            raise MeteredError(f"{path}: line {line}: token counts must be integers and gpu_ms a number") from None
        if totals.input_tokens < 0 or totals.output_tokens < 0 or not totals.gpu_ms >= 0:
            raise MeteredError(f"{path}: line {line}: negative usage")
        if row["tenant"] in out:
            raise MeteredError(f"{path}: line {line}: tenant {row['tenant']!r} appears twice")
        out[row["tenant"]] = totals
    return out


def _differs(a: float, b: float, threshold: float) -> bool:
    return abs(a - b) > threshold * max(abs(a), abs(b), 1.0)


async def reconcile(ledger: Ledger, metered: dict[str, Totals] | None = None, threshold: float = 0.01,
                    freeze: bool = True) -> ReconcileReport:
    """Compare the views per tenant; freeze and alert where they differ by more than ``threshold``.

    Reservations and events must agree exactly (both are the ledger's own records); the metered export
    may differ by ``threshold`` (relative, per dimension) before it counts.
    """
    reservations = await ledger.reservations()
    events = await ledger.events()
    tenants = sorted({r.tenant for r in reservations} | set(metered or {}))
    report = ReconcileReport([], [])
    for tenant in tenants:
        mine = [r for r in reservations if r.tenant == tenant]
        booked = Totals(sum(r.billed.input_tokens for r in mine), sum(r.billed.output_tokens for r in mine),
                        sum(r.billed.gpu_ms for r in mine))
        logged = [e for e in events if e.tenant == tenant]
        logged_totals = Totals(sum(e.input_tokens for e in logged), sum(e.output_tokens for e in logged),
                               sum(e.gpu_ms for e in logged))
        row = TenantReconciliation(tenant, booked, logged_totals, (metered or {}).get(tenant) if metered else None,
                                   sum(1 for r in mine if r.status == "open"))
        for name in ("input_tokens", "output_tokens", "gpu_ms"):
            a, b = getattr(booked, name), getattr(logged_totals, name)
            if _differs(a, b, 1e-9):
                row.differences.append(f"{name}: reservations {a:g} != event log {b:g}")
            if metered is not None:
                m = getattr(row.metered or Totals(), name)
                if _differs(b, m, threshold):
                    row.differences.append(f"{name}: event log {b:g} vs metered {m:g} (over {threshold:.1%})")
        if row.differences:
            kind = "metered" if any("metered" in d for d in row.differences) else "ledger"
            ALERTS.labels(tenant_tag(tenant), kind).inc()
            log.warning(json.dumps({"alert": "reconciliation", "tenant_hash": tenant_tag(tenant),
                                    "differences": row.differences}))
            if freeze:
                await ledger.freeze(tenant, "; ".join(row.differences))
                report.frozen.append(tenant)
        report.tenants.append(row)
    return report
