"""The quota ledger: reserve / settle / cancel, atomic and idempotent, on SQLite, PostgreSQL or Redis.

``await fairgate.ledger.connect(url, quotas)`` opens the backend named by the URL:
``sqlite:///relative.db`` or ``sqlite:////absolute.db`` (as in SQLAlchemy), ``postgresql://user@host/db?schema=name``, ``redis://host:6379/0?prefix=name``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

from fairgate.ledger.base import Coordination, Event, IsRunning, Ledger, Operator, RequestPath
from fairgate.ledger.config import Limits, QuotaConfigError, Quotas, load_quotas, quotas_from_dict
from fairgate.ledger.model import (
    IdempotencyConflict,
    InvalidUsage,
    LedgerError,
    LedgerUnavailable,
    QuotaExceeded,
    Reservation,
    ReservationFinal,
    ReservationNotFound,
    SettlementFrozen,
    TenantUsage,
    UnknownTenant,
    Usage,
)


async def connect(
    url: str, quotas: Quotas | str | Path, clock: Callable[[], float] | None = None, create: bool = True
) -> Ledger:
    """Open the ledger backend named by ``url`` with ``quotas`` (a ``Quotas`` or a TOML path).

    Args:
        clock: ms since the epoch, replacing the backend's own clock (tests).
        create: make the ledger (file, schema, keys) if it does not exist; ``False``: it must exist
            (``LedgerUnavailable`` otherwise), as operator commands want.

    Raises:
        ValueError: an unknown URL scheme. QuotaConfigError: bad quotas. LedgerUnavailable: cannot connect.
    """
    if not isinstance(quotas, Quotas):
        quotas = load_quotas(quotas)
    scheme = urlparse(url).scheme
    if scheme == "sqlite":
        from fairgate.ledger.sqlite import SqliteLedger

        if not url.startswith("sqlite:///") or url == "sqlite:///":
            raise ValueError(f"ledger URL {url!r}: expected sqlite:///relative/path.db or sqlite:////absolute/path.db")
        return SqliteLedger(url[len("sqlite:///") :], quotas, clock, create=create)
    if scheme in ("postgresql", "postgres"):
        from fairgate.ledger.postgres import PostgresLedger

        return await PostgresLedger.open(url, quotas, clock, create=create)
    if scheme in ("redis", "rediss"):
        from fairgate.ledger.redis import RedisLedger

        return await RedisLedger.open(url, quotas, clock, create=create)
    raise ValueError(
        f"ledger URL {url!r}: unknown scheme {scheme!r}; use sqlite:///path, postgresql://... or redis://..."
    )


def check_url(url: str) -> None:
    """Check a ledger URL without connecting (as ``connect`` would parse it). Raises ``ValueError`` naming the
    part at fault."""
    scheme = urlparse(url).scheme
    if scheme == "sqlite":
        if not url.startswith("sqlite:///") or url == "sqlite:///":
            raise ValueError(f"ledger URL {url!r}: expected sqlite:///relative/path.db or sqlite:////absolute/path.db")
    elif scheme in ("postgresql", "postgres"):
        from fairgate.ledger.postgres import _parse_url as parse_postgres

        parse_postgres(url)
    elif scheme in ("redis", "rediss"):
        from fairgate.ledger.redis import _parse_url as parse_redis

        parse_redis(url)
    else:
        raise ValueError(
            f"ledger URL {url!r}: unknown scheme {scheme!r}; use sqlite:///path, postgresql://... or redis://..."
        )


__all__ = [
    "Event",
    "IdempotencyConflict",
    "InvalidUsage",
    "IsRunning",
    "Ledger",
    "LedgerError",
    "LedgerUnavailable",
    "Limits",
    "QuotaConfigError",
    "QuotaExceeded",
    "Quotas",
    "Reservation",
    "ReservationFinal",
    "ReservationNotFound",
    "SettlementFrozen",
    "TenantUsage",
    "UnknownTenant",
    "Usage",
    "check_url",
    "connect",
    "load_quotas",
    "quotas_from_dict",
]
