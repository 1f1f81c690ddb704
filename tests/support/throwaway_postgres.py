"""A throwaway PostgreSQL server for a machine where none answers.

pytest-postgresql starts one with ``pg_ctl``, which refuses to run as root; the machines here run as
root. This starts the same binaries as the unprivileged ``postgres`` user (``runuser``) when needed, in a
temporary data directory, on a free port of 127.0.0.1, with trust authentication, and stops it after.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _bindir() -> Path:
    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if (Path(candidate) / "initdb").exists():
            return Path(candidate)
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    raise RuntimeError("no PostgreSQL server answers and none is installed: apt-get install postgresql")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def throwaway_postgres() -> Iterator[str]:
    """Start a server in a new temporary directory; yields its URL (database and user ``postgres``).

    The directory is made directly under the system temp dir: the ``postgres`` user must be able to reach
    it, which pytest's root-only temp tree does not allow.
    """
    base = Path(tempfile.mkdtemp(prefix="fairgate-pg-"))
    try:
        yield from _serve(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _serve(base: Path) -> Iterator[str]:
    bindir = _bindir()
    data, sockets = base / "pgdata", base / "pgsock"
    data.mkdir(parents=True)
    sockets.mkdir()
    as_user: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(base, "postgres")
        shutil.chown(data, "postgres")
        shutil.chown(sockets, "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    port = _free_port()
    subprocess.run(
        [
            *as_user,
            str(bindir / "initdb"),
            "-D",
            str(data),
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
            "-E",
            "UTF8",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    options = f"-p {port} -c listen_addresses=127.0.0.1 -k {sockets} -c fsync=off"
    subprocess.run(
        [
            *as_user,
            str(bindir / "pg_ctl"),
            "-D",
            str(data),
            "-o",
            options,
            "-l",
            str(base / "log"),
            "-w",
            "-t",
            "60",
            "start",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            [*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
            capture_output=True,
            timeout=60,
        )
