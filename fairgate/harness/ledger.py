"""What a stack's ledger holds, read the way the drills compare it: each tenant's totals (``LedgerReport``,
with differences between two readings and GPU shares), a tenant's requests as its clients saw them beside
its reservations (``RequestOutcomes``), waiting until nothing is open, and a fresh schema or key prefix on a
shared PostgreSQL / Redis server (dropped after)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlencode, urlparse, urlunparse

from fairgate.ledger.model import TenantUsage

if TYPE_CHECKING:
    from fairgate.harness.records import TenantStats
    from fairgate.ledger import Ledger, Reservation

ALL_TIME_S = 10 * 365 * 86_400.0  # a usage window that covers every reservation of a drill

# Limits no benchmark reaches (rates per minute and concurrency): what it measures is the ledger's work.
UNREACHED_LIMITS = {
    "requests_per_minute": 1e9,
    "requests_burst": 1e9,
    "max_concurrent": 1000,
    "input_tokens_per_minute": 1e12,
    "output_tokens_per_minute": 1e12,
}


def bench_quotas(tenants: int) -> dict[str, object]:
    """A quota file (as a dict, for ``quotas_from_dict``) of ``tenants`` tenants ``bench0``, ``bench1``, ...
    under ``UNREACHED_LIMITS``."""
    return {"defaults": UNREACHED_LIMITS, "tenants": {f"bench{i}": {} for i in range(tenants)}}


@dataclass(frozen=True)
class RequestOutcomes:
    """One tenant's requests end to end, as counts: what its clients saw (sent, answered 200, hung up on, errors
    by ``RequestRecord.error``) and its reservations in the ledger by status."""

    sent: int
    ok: int
    cut: int
    errors: dict[str, int]
    reservations: int
    settled: int
    cancelled: int
    open: int

    @classmethod
    def of(cls, stats: TenantStats, reservations: Iterable[Reservation]) -> RequestOutcomes:
        """From the tenant's client figures and its reservations (those of no other tenant)."""
        statuses = Counter(r.status for r in reservations)
        return cls(
            stats.requests,
            stats.completed,
            stats.cut,
            stats.errors,
            statuses.total(),
            statuses["settled"],
            statuses["cancelled"],
            statuses["open"],
        )


@dataclass(frozen=True)
class LedgerReport:
    """Every tenant's ledger totals at one moment, and its share of the GPU time billed."""

    totals: dict[str, TenantUsage]  # all time: reservations made, billed tokens and GPU ms, reservations by status

    @property
    def gpu_ms(self) -> float:
        return sum(t.gpu_ms for t in self.totals.values())

    def minus(self, before: LedgerReport) -> LedgerReport:
        """What was billed since ``before`` (an earlier report of the same ledger)."""
        totals = {}
        for name, now in self.totals.items():
            then = before.totals.get(name, TenantUsage(name, now.window_s, 0, 0, 0, 0.0, 0.0, {}))
            statuses = set(now.by_status) | set(then.by_status)
            totals[name] = TenantUsage(
                name,
                now.window_s,
                now.requests - then.requests,
                now.input_tokens - then.input_tokens,
                now.output_tokens - then.output_tokens,
                now.gpu_ms - then.gpu_ms,
                now.overage_gpu_ms - then.overage_gpu_ms,
                {k: now.by_status.get(k, 0) - then.by_status.get(k, 0) for k in statuses},
                now.spend_micros - then.spend_micros,
            )
        return LedgerReport(totals)

    def shares(self) -> dict[str, float]:
        """Tenant -> fraction of all GPU ms billed (0 for every tenant when nothing was billed)."""
        total = self.gpu_ms
        return {name: (t.gpu_ms / total if total > 0 else 0.0) for name, t in self.totals.items()}


async def ledger_totals(ledger: Ledger, tenants: Sequence[str]) -> LedgerReport:
    """Each of ``tenants``' totals in ``ledger`` now."""
    return LedgerReport({tenant: await ledger.usage(tenant, ALL_TIME_S) for tenant in tenants})


async def wait_settled(ledger: Ledger, limit_s: float) -> float:
    """Wait until no reservation is open (the gateways billed every end and hang-up), at most ``limit_s``;
    returns the seconds waited."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while loop.time() - start < limit_s:
        if not await ledger.reservations(status="open"):
            break
        await asyncio.sleep(0.1)
    return loop.time() - start


def fresh_ledger_url(base: str, token: str) -> str:
    """``base`` (``postgresql://...`` or ``redis://...``) with a schema / key prefix of its own (``token``);
    any other URL (``sqlite:///``) is returned as is."""
    parts = urlparse(base)
    name = {"postgresql": "schema", "postgres": "schema", "redis": "prefix", "rediss": "prefix"}.get(parts.scheme)
    if name is None:
        return base
    query = [(k, v) for k, v in parse_qsl(parts.query) if k != name] + [(name, token)]
    return urlunparse(parts._replace(query=urlencode(query)))


def backend_of(url: str) -> str:
    """``sqlite``, ``postgresql`` or ``redis``."""
    scheme = urlparse(url).scheme
    return {"postgres": "postgresql", "rediss": "redis"}.get(scheme, scheme)


async def drop_ledger(ledger: Ledger) -> None:
    """Drop the ledger's schema / keys (PostgreSQL, Redis; best effort: the server may be gone)."""
    drop = getattr(ledger, "drop_schema", None) or getattr(ledger, "drop_keys", None)
    if drop is not None:
        try:
            await drop()
        except Exception:
            pass


__all__ = [
    "ALL_TIME_S",
    "LedgerReport",
    "RequestOutcomes",
    "backend_of",
    "drop_ledger",
    "fresh_ledger_url",
    "ledger_totals",
    "wait_settled",
]
