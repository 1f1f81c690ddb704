"""The quota ledger: reserve / settle / cancel, atomic and idempotent, on SQLite, PostgreSQL or Redis.

``await fairgate.ledger.connect(url, quotas)`` opens the backend named by the URL:
``sqlite:///relative.db`` or ``sqlite:////absolute.db`` (as in SQLAlchemy),
``postgresql://user@host/db?schema=name``, ``redis://host:6379/0?prefix=name``. ``SCHEMES`` lists the
schemes; ``check_url`` checks a URL without connecting.

Layout: ``base`` (the interfaces: ``RequestPath``, ``Operator``, ``Coordination``, ``Ledger``), ``model``
(reservations, usage, events, errors), ``config`` (quotas), ``rules`` (the semantics as pure functions),
``checks`` (argument checks), ``backend`` (what every backend does alike), ``sql`` + ``sql_schema`` with
``sqlite`` / ``postgres``, and the ``redis`` package (the backends), ``schemes`` (the backends by URL scheme),
``urls`` and ``text`` (parsing URLs, one-line messages), ``emergency`` (``ResilientLedger``: the outage
policy), ``reconcile``.

How to add a backend:

1. Write one module (or package) ``fairgate/ledger/<name>.py`` with a ledger class, usually a subclass of
   ``backend.Backend`` supplying its storage steps, and the two functions of ``schemes.BackendModule``:
   ``check_url(url)`` (parse with ``urls.split``, raise ``ValueError`` naming the part at fault) and
   ``async open_ledger(url, quotas, clock, create)``. Wrap the driver's errors once, at the driver call,
   into ``LedgerUnavailable`` (a server fault) or ``InvalidUsage`` (the caller's input).
2. Add one line to ``schemes._BACKENDS``: its schemes, its module, how an error shows it.
3. Add it to ``BACKENDS`` in ``tests/ledger/conftest.py`` (and a fresh URL for it in ``backend_url``): the
   conformance suite then runs every test body on it too, and it must pass them unchanged.
"""

from __future__ import annotations

from pathlib import Path

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
from fairgate.ledger.schemes import SCHEMES, Clock, backend_for


async def connect(url: str, quotas: Quotas | str | Path, clock: Clock | None = None, create: bool = True) -> Ledger:
    """Open the ledger backend named by ``url`` with ``quotas`` (a ``Quotas`` or a TOML path).

    Args:
        clock: ms since the epoch, replacing the backend's own clock (tests).
        create: make the ledger (file, schema, keys) if it does not exist; ``False``: it must exist
            (``LedgerUnavailable`` otherwise), as operator commands want.

    Raises:
        ValueError: an unknown URL scheme, or a bad URL for its backend. QuotaConfigError: bad quotas.
        LedgerUnavailable: cannot connect.
    """
    if not isinstance(quotas, Quotas):
        quotas = load_quotas(quotas)
    return await backend_for(url).open_ledger(url, quotas, clock, create)


def check_url(url: str) -> None:
    """Check a ledger URL without connecting (as ``connect`` would parse it). Raises ``ValueError`` naming the
    part at fault."""
    backend_for(url).check_url(url)


__all__ = [
    "SCHEMES",
    "Coordination",
    "Event",
    "IdempotencyConflict",
    "InvalidUsage",
    "IsRunning",
    "Ledger",
    "LedgerError",
    "LedgerUnavailable",
    "Limits",
    "Operator",
    "QuotaConfigError",
    "QuotaExceeded",
    "Quotas",
    "RequestPath",
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
