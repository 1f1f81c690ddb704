"""A throwaway ``redis-server`` of its own on a free port of 127.0.0.1 (never the shared server), supervised
by ``ServerProcess``: a drill stops and starts it again (same port and data) to cut the ledger off."""

from __future__ import annotations

import shutil
import signal
import socket
from pathlib import Path

from fairgate.harness.process import ServerProcess, free_port


def redis_server(folder: Path, durable: bool = True, binary: str | None = None) -> ServerProcess:
    """A redis-server with its data and log in ``folder`` (not started yet).

    ``durable``: append-only file with ``appendfsync always``, so stopping it (even SIGKILL) and starting it
    again keeps every write it acknowledged: a ledger outage, not a ledger wipe.

    Raises:
        RuntimeError: no redis-server binary.
    """
    found = binary or shutil.which("redis-server")
    if found is None:
        raise RuntimeError("the drill needs redis-server (Debian: apt-get install redis-server)")
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    persistence = ["--appendonly", "yes", "--appendfsync", "always"] if durable else ["--appendonly", "no"]
    argv = [found, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder), "--save", "", *persistence]
    argv += ["--daemonize", "no", "--protected-mode", "no"]
    return ServerProcess(
        argv, port, f"redis://127.0.0.1:{port}/0", folder / "redis.log", lambda: _pong(port), signal.SIGTERM
    )


def redis_url(server: ServerProcess, prefix: str, timeout_s: float = 1.0) -> str:
    """The ledger URL of ``server`` with key ``prefix`` and a client timeout of ``timeout_s``."""
    return f"{server.url}?prefix={prefix}&timeout_s={timeout_s:g}"


def _pong(port: int) -> bool:
    """True when the server answers PING with PONG (not while it loads its data)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


__all__ = ["redis_server", "redis_url"]
