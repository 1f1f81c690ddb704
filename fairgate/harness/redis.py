"""A throwaway ``redis-server`` of its own on a free port of 127.0.0.1 (never the shared server), supervised
by ``ServerProcess``: a drill stops and starts it again (same port and data) to cut the ledger off."""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from fairgate.harness.process import ServerProcess, free_port


def redis_server(
    folder: Path, durable: bool = True, binary: str | None = None, extra: Sequence[str] = ()
) -> ServerProcess:
    """A redis-server with its data and log in ``folder`` (not started yet).

    ``durable``: append-only file with ``appendfsync always``, so stopping it (even SIGKILL) and starting it
    again keeps every write it acknowledged: a ledger outage, not a ledger wipe. ``extra``: more arguments.

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
    argv += ["--daemonize", "no", "--protected-mode", "no", *extra]
    return ServerProcess(
        argv, port, f"redis://127.0.0.1:{port}/0", folder / "redis.log", lambda: _pong(port), signal.SIGTERM
    )


@contextmanager
def redis_cluster(folder: Path, masters: int = 3) -> Iterator[list[ServerProcess]]:
    """A Redis Cluster of ``masters`` throwaway nodes (no replicas), each in a folder of ``folder``, joined
    with ``redis-cli --cluster create`` and the 16,384 slots spread evenly; yields the running nodes once
    every node says ``cluster_state:ok``; stops them after.

    Raises:
        RuntimeError: no redis-server or redis-cli binary, or the cluster did not form within 30 s.
    """
    cli = shutil.which("redis-cli")
    if cli is None:
        raise RuntimeError("a Redis Cluster needs redis-cli (Debian: apt-get install redis-server)")
    # The cluster bus port is given (default: the port + 10,000, which a free port above 55,535 cannot have).
    cluster_args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "5000"]
    nodes = [
        redis_server(folder / f"node{i}", durable=False, extra=[*cluster_args, "--cluster-port", str(free_port())])
        for i in range(masters)
    ]
    with contextlib.ExitStack() as stack:
        for node in nodes:
            stack.enter_context(node)
        addresses = [f"127.0.0.1:{node.port}" for node in nodes]
        create = [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"]
        subprocess.run(create, check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + 30.0
        while not all(_cluster_ok(cli, node.port) for node in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Redis Cluster on {', '.join(addresses)} did not reach cluster_state:ok")
            time.sleep(0.2)
        yield nodes


def _cluster_ok(cli: str, port: int) -> bool:
    done = subprocess.run([cli, "-p", str(port), "cluster", "info"], capture_output=True, text=True, timeout=10)
    return "cluster_state:ok" in done.stdout


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


__all__ = ["redis_cluster", "redis_server", "redis_url"]
