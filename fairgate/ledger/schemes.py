"""The ledger backends by URL scheme: the one place ``connect`` and ``check_url`` look a backend up.

A backend is a module with two functions (``BackendModule``): ``check_url(url)``, which checks a URL
without connecting, and ``open_ledger(url, quotas, clock, create)``, which opens the ledger. It is imported
only when a URL names it, so a deployment on SQLite never imports a PostgreSQL or Redis driver.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from typing import Protocol, cast
from urllib.parse import urlparse

from fairgate.ledger.base import Ledger
from fairgate.ledger.config import Quotas

Clock = Callable[[], float]  # ms since the epoch


class BackendModule(Protocol):
    """What a backend module provides."""

    def check_url(self, url: str) -> None:
        """Check ``url`` as ``open_ledger`` would parse it, without connecting. Raises ``ValueError``."""

    def open_ledger(self, url: str, quotas: Quotas, clock: Clock | None, create: bool) -> Awaitable[Ledger]:
        """Open the ledger at ``url`` (see ``fairgate.ledger.connect``)."""


# One line per backend: its schemes, its module, and how the error for an unknown scheme shows it.
_BACKENDS: list[tuple[tuple[str, ...], str, str]] = [
    (("sqlite",), "fairgate.ledger.sqlite", "sqlite:///path"),
    (("postgresql", "postgres"), "fairgate.ledger.postgres", "postgresql://..."),
    (("redis", "rediss"), "fairgate.ledger.redis", "redis://..."),
]
_MODULES = {scheme: module for schemes, module, _ in _BACKENDS for scheme in schemes}
SCHEMES: tuple[str, ...] = tuple(_MODULES)
"""Every scheme a ledger URL may have."""


def backend_for(url: str) -> BackendModule:
    """The backend module for ``url``'s scheme. Raises ``ValueError`` for a scheme no backend has (or a URL
    that is not text)."""
    if not isinstance(url, str):
        raise ValueError(f"ledger URL must be a string, got {type(url).__name__}")
    scheme = urlparse(url).scheme
    module = _MODULES.get(scheme)
    if module is None:
        shown = [example for _, _, example in _BACKENDS]
        raise ValueError(f"ledger URL {url!r}: unknown scheme {scheme!r}; use {', '.join(shown[:-1])} or {shown[-1]}")
    return cast(BackendModule, importlib.import_module(module))
