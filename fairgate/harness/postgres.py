"""A throwaway PostgreSQL server for a machine where none answers: the installed binaries, a new data
directory, a free port of 127.0.0.1, trust authentication; supervised by ``ServerProcess`` and removed after.

PostgreSQL refuses to run as root: as root, the server runs as the ``postgres`` user, and its directory is
made directly under the system temp dir (that user cannot reach a root-only temp tree).
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fairgate.harness.process import ServerProcess, free_port


def _bindir() -> Path:
    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if (Path(candidate) / "initdb").exists():
            return Path(candidate)
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    raise RuntimeError("no PostgreSQL server answers and none is installed: apt-get install postgresql")


@contextmanager
def throwaway_postgres() -> Iterator[str]:
    """Start a server in a new temporary directory; yields its URL (database and user ``postgres``).

    Raises:
        RuntimeError: no PostgreSQL binaries, or the server did not start.
    """
    with throwaway_postgres_server() as server:
        yield server.url


@contextmanager
def throwaway_postgres_server() -> Iterator[ServerProcess]:
    """``throwaway_postgres``, yielding the running server itself, which a drill may stop and start again
    (same port and data) or pause. Raises as ``throwaway_postgres``."""
    bindir = _bindir()
    base = Path(tempfile.mkdtemp(prefix="fairgate-pg-"))
    user = "postgres" if os.geteuid() == 0 else None
    data, sockets = base / "pgdata", base / "pgsock"
    try:
        for folder in (data, sockets):
            folder.mkdir()
        if user is not None:
            for folder in (base, data, sockets):
                shutil.chown(folder, user)
        initdb = [str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8"]
        subprocess.run(initdb, check=True, capture_output=True, timeout=120, user=user)
        port = free_port()
        argv = [str(bindir / "postgres"), "-D", str(data), "-p", str(port), "-k", str(sockets)]
        argv += ["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"]
        ready = [str(bindir / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(port)]
        server = ServerProcess(
            argv,
            port,
            f"postgresql://postgres@127.0.0.1:{port}/postgres",
            base / "log",
            lambda: subprocess.run(ready, timeout=10).returncode == 0,
            stop_signal=signal.SIGQUIT,  # immediate shutdown: the data is thrown away
            user=user,
        )
        with server:
            yield server
    finally:
        shutil.rmtree(base, ignore_errors=True)


__all__ = ["throwaway_postgres", "throwaway_postgres_server"]
