"""Text for error messages about ledger servers: one line, passwords hidden."""

from __future__ import annotations

import re


def one_line(text: object, limit: int = 300) -> str:
    """The first non-empty line of ``text``, whitespace collapsed, at most ``limit`` characters."""
    line = next((ln for ln in str(text).splitlines() if ln.strip()), "")
    line = " ".join(line.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def redacted(url: str) -> str:
    """``url`` with its password (in the user info or a ``password`` parameter) replaced by ``***``."""
    url = re.sub(r"(?i)([?&]password=)[^&#]*", r"\1***", url)
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    userinfo, at, host = rest[:end].rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{host}{rest[end:]}"
