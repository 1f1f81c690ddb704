"""A throwaway PgBouncer in transaction mode in front of a PostgreSQL server: the installed ``pgbouncer``
(Debian's package), a new directory, a free port of 127.0.0.1, no client authentication (the server behind
it trusts loopback); supervised by ``ServerProcess`` and removed after.

In transaction mode each transaction may run on another server connection, so nothing of a session survives
between two transactions (``SET``, prepared statements, session advisory locks): what the PostgreSQL ledger
must do without behind it (``fairgate.ledger.postgres``, URL parameter ``pooler=transaction``). PgBouncer
refuses to run as root: as root it runs as the ``postgres`` user (``-u``), its directory made directly
under the system temp dir.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from fairgate.harness.process import ServerProcess, free_port

POOL_SIZE = 20  # server connections per database and user: fewer than the clients a test opens


def _binary() -> str:
    found = shutil.which("pgbouncer") or ("/usr/sbin/pgbouncer" if Path("/usr/sbin/pgbouncer").exists() else None)
    if found is None:
        raise RuntimeError("pgbouncer is not installed: apt-get install pgbouncer")
    return found


def _ini(server_host: str, server_port: int, server_user: str, port: int, base: Path) -> str:
    return "\n".join(
        [
            "[databases]",
            # auth_type = any logs every client in as the database's user: the server's.
            f"* = host={server_host} port={server_port} user={server_user}",
            "[pgbouncer]",
            "listen_addr = 127.0.0.1",
            f"listen_port = {port}",
            "unix_socket_dir =",
            "auth_type = any",
            "pool_mode = transaction",
            f"default_pool_size = {POOL_SIZE}",
            "max_client_conn = 500",
            f"logfile = {base / 'pgbouncer.log'}",
            f"pidfile = {base / 'pgbouncer.pid'}",
            "",
        ]
    )


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@contextmanager
def pgbouncer_in_front(postgres_url: str) -> Iterator[str]:
    """Start PgBouncer (transaction mode) in front of ``postgres_url``'s server; yields the same URL with
    PgBouncer's host and port. Raises ``RuntimeError``: no ``pgbouncer`` binary, or it did not start."""
    parts = urlsplit(postgres_url)
    base = Path(tempfile.mkdtemp(prefix="fairgate-pgbouncer-"))
    user = "postgres" if os.geteuid() == 0 else None
    try:
        port = free_port()
        ini = base / "pgbouncer.ini"
        server_user = parts.username or "postgres"
        ini.write_text(_ini(parts.hostname or "127.0.0.1", parts.port or 5432, server_user, port, base))
        if user is not None:
            shutil.chown(base, user)
            shutil.chown(ini, user)
        argv = [_binary(), *(["-u", user] if user is not None else []), str(ini)]
        netloc = f"{server_user}@127.0.0.1:{port}"
        url = urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))
        server = ServerProcess(argv, port, url, base / "stdout.log", lambda: _answers(port), user=None)
        with server:
            yield url
    finally:
        shutil.rmtree(base, ignore_errors=True)


__all__ = ["POOL_SIZE", "pgbouncer_in_front"]
