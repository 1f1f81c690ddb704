"""What every ``fairgate`` command shares: its consoles, and the one-line error with exit code 2.

Every error a user can cause (a bad file, key, value or option) prints one line naming the file and key
or line, and exits with code 2; no traceback. User text (file names, keys, values) is printed as it is:
no rich markup, no emoji codes.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import typer
from rich.console import Console

_WIDTH = None if sys.stdout.isatty() else 140  # tables stay whole when piped or captured
console = Console(width=_WIDTH)
error_console = Console(stderr=True, width=_WIDTH)


def fail(message: str) -> typer.Exit:
    """Print ``error: <message>`` on stderr; the ``typer.Exit(2)`` to raise."""
    error_console.print(f"error: {message}", markup=False, emoji=False, highlight=False, soft_wrap=True)
    return typer.Exit(code=2)


def check_port(host: str, port: int) -> None:
    """A port in use (or an address not of this machine) is a one-line error, before anything is printed or
    started (``fairgate serve``, ``fairgate emulate``). Raises ``typer.Exit(2)`` naming ``--host`` and ``--port``."""
    try:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
            probe.bind((host, port))
    except OSError as exc:
        raise fail(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})") from None


def output_dir(target: str | Path, option: str, error: type[Exception]) -> Path:
    """The folder ``target`` given as ``option`` (``--plot``, ``--out``), created if missing, checked before any
    work is done. Raises ``error`` with one line naming the option."""
    if not str(target).strip():
        raise error(f"{option}: give a directory")
    path = Path(target)
    if path.exists() and not path.is_dir():
        raise error(f"{option} {target}: exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise error(f"{option} {target}: cannot create the directory: {exc.strerror or exc}") from None
    return path


def note(message: str) -> None:
    """Print ``message`` on stderr as it is."""
    error_console.print(message, markup=False, emoji=False, highlight=False, soft_wrap=True)


def say(message: str) -> None:
    """Print ``message`` on stdout as it is, at once: what a command was asked for (keys, URLs), not a remark
    about how it went (``note``)."""
    print(message, flush=True)
