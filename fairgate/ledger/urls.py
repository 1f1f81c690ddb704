"""Parsing ledger URLs: what every backend's URL check does alike, each error a one-line ``ValueError``
naming the part at fault, with the password hidden (``text.redacted``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import SplitResult, parse_qsl, urlsplit

from fairgate.ledger.text import one_line, redacted

DEFAULT_TIMEOUT_S = 2.0  # how long connecting, and on Redis every reply, may take: an outage is noticed fast
MAX_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class LedgerUrl:
    """A ledger URL split into its parts.

    Attributes:
        text: the URL as given.
        shown: the URL as error messages show it (password replaced by ``***``).
        parts: ``urllib.parse.urlsplit``'s parts.
    """

    text: str
    shown: str
    parts: SplitResult

    def query(self) -> tuple[list[str], dict[str, str]]:
        """The query's parameter names in order, and the parameters. Raises ``ValueError`` for a parameter
        given more than once (which one was meant is not for us to guess)."""
        pairs = parse_qsl(self.parts.query, keep_blank_values=True)
        names = [name for name, _ in pairs]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(
                f"ledger URL {self.shown!r}: parameter(s) given more than once: {', '.join(map(repr, repeated))}"
            )
        return names, dict(pairs)


def split(url: object) -> LedgerUrl:
    """Split ``url``. Raises ``ValueError``: not a string, or malformed (an unbalanced IPv6 bracket, ...)."""
    if not isinstance(url, str):
        raise ValueError(f"ledger URL must be a string, got {type(url).__name__}")
    shown = redacted(url)
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ValueError(f"ledger URL {shown!r}: malformed ({one_line(exc)})") from None
    return LedgerUrl(url, shown, parts)


def number(text: str) -> float:
    """``text`` as a finite float; NaN when it is not one (every range check then fails)."""
    try:
        value = float(text)
    except ValueError:
        return math.nan
    return value if math.isfinite(value) else math.nan


def timeout_s(text: str | None) -> float:
    """The ``timeout_s`` parameter (None: not given, ``DEFAULT_TIMEOUT_S``): seconds in (0, 600].
    Raises ``ValueError``."""
    given = str(DEFAULT_TIMEOUT_S) if text is None else text
    value = number(given)
    if not 0 < value <= MAX_TIMEOUT_S:
        raise ValueError(f"ledger URL: timeout_s {given!r} must be a number of seconds in (0, 600]")
    return value
