"""What every ``fairgate`` command shares: its consoles, and the one-line error with exit code 2.

Every error a user can cause (a bad file, key, value or option) prints one line naming the file and key
or line, and exits with code 2; no traceback. User text (file names, keys, values) is printed as it is:
no rich markup, no emoji codes.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console

_WIDTH = None if sys.stdout.isatty() else 140  # tables stay whole when piped or captured
console = Console(width=_WIDTH)
error_console = Console(stderr=True, width=_WIDTH)


def fail(message: str) -> typer.Exit:
    """Print ``error: <message>`` on stderr; the ``typer.Exit(2)`` to raise."""
    error_console.print(f"error: {message}", markup=False, emoji=False, highlight=False, soft_wrap=True)
    return typer.Exit(code=2)


def note(message: str) -> None:
    """Print ``message`` on stderr as it is."""
    error_console.print(message, markup=False, emoji=False, highlight=False, soft_wrap=True)
