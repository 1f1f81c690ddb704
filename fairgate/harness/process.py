"""The process supervisor: a server process on loopback that is started, waited for, signalled and always
reaped by the object that started it (never a process it did not start).

``ServerProcess`` runs any argv (a ``python -m fairgate`` command or a server binary such as
``redis-server``) with its output appended to a log file, and knows when it is ready by a probe (by default:
``GET <url>/health`` answers 200). ``fairgate_server`` builds one for ``python -m fairgate ARGS``;
``running`` starts several at once and stops them all when its block ends.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

STARTUP_S_MAX = 30.0  # a server that is not ready by then failed to start
STOP_S_MAX = 30.0  # after SIGTERM, the wait before SIGKILL


def free_port() -> int:
    """A TCP port of 127.0.0.1 free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def health_probe(url: str) -> Callable[[], bool]:
    """True once ``GET <url>/health`` answers 200."""

    def probe() -> bool:
        import httpx

        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    return probe


class ServerProcess:
    """One server process on 127.0.0.1.

    Attributes:
        argv: the command. url: where it answers (``http://127.0.0.1:<port>`` or a database URL).
        port: its port. log_path: its stdout and stderr, appended (None: discarded).
        ready: the probe that says it serves. stop_signal: the signal of a clean ``stop`` (SIGTERM).
        user: run it as this user (a server that refuses root); None: as this process.
    """

    def __init__(
        self,
        argv: Sequence[str],
        port: int,
        url: str | None = None,
        log_path: Path | None = None,
        ready: Callable[[], bool] | None = None,
        stop_signal: int = signal.SIGTERM,
        user: str | None = None,
    ) -> None:
        self.argv = list(argv)
        self.port = port
        self.url = url or f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.ready = ready or health_probe(self.url)
        self.stop_signal = stop_signal
        self.user = user
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        """For messages: the program and its first argument (``fairgate serve``, ``redis-server --port``)."""
        program = "fairgate" if self.argv[0] == sys.executable else Path(self.argv[0]).name
        return " ".join([program, *(self.argv[3:4] if program == "fairgate" else self.argv[1:2])])

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def start(self) -> ServerProcess:
        """Start it (again, after it ended: same command, port and log). Does not wait until it is ready."""
        if self.alive:
            return self
        with open(self.log_path or os.devnull, "ab") as log:  # the child keeps its own descriptor
            self.popen = subprocess.Popen(self.argv, stdout=log, stderr=log, user=self.user)
        return self

    def wait_ready(self, timeout_s: float = STARTUP_S_MAX) -> ServerProcess:
        """Wait until the probe says it serves.

        Raises:
            RuntimeError: it ended, or was not ready within ``timeout_s`` (its log's tail in the message).
        """
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if not self.alive or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} on port {self.port} did not start:\n{self.log_tail()}")
            time.sleep(0.05)
        return self

    def send(self, sig: int) -> None:
        """Send ``sig`` if it runs (SIGSTOP / SIGCONT pause and resume it)."""
        if self.alive:
            assert self.popen is not None
            self.popen.send_signal(sig)

    def send_tree(self, sig: int) -> None:
        """Send ``sig`` to it and every process it started (a PostgreSQL server's backends serve the open
        connections: SIGSTOP to the postmaster alone pauses nothing a client holds)."""
        if self.alive:
            assert self.popen is not None
            for pid in [self.popen.pid, *descendants(self.popen.pid)]:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass  # it ended meanwhile

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (default SIGKILL: a crash, no clean-up) and reap it; SIGKILL if it outlives STOP_S_MAX."""
        if sig != signal.SIGKILL:
            self.send(signal.SIGCONT)  # a paused process must run to handle the signal
        self.send(sig)
        self._reap()

    def stop(self) -> None:
        """A clean shutdown (``stop_signal``), then SIGKILL after STOP_S_MAX; always reaped."""
        self.kill(self.stop_signal)

    def _reap(self) -> None:
        if self.popen is None:
            return
        try:
            self.popen.wait(timeout=STOP_S_MAX)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=STOP_S_MAX)

    def log_tail(self, lines: int = 20) -> str:
        if self.log_path is None:
            return "(log discarded)"
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> ServerProcess:
        return self.start().wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (children, their children, ...), read from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it ended while being read
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        found = children.get(todo.pop(), [])
        out += found
        todo += found
    return out


def fairgate_server(args: Sequence[str], port: int | None = None, log_path: Path | None = None) -> ServerProcess:
    """``python -m fairgate ARGS`` serving HTTP on ``port`` (default: a free one; ARGS get ``--port``)."""
    if port is None:
        port = free_port()
        args = [*args, "--port", str(port)]
    return ServerProcess([sys.executable, "-m", "fairgate", *args], port, log_path=log_path)


@contextmanager
def running(servers: Sequence[ServerProcess]) -> Iterator[list[ServerProcess]]:
    """Start every server at once, wait until each is ready, and stop them all when the block ends.

    Raises:
        RuntimeError: a server did not start (see ``ServerProcess.wait_ready``).
    """
    with ExitStack() as stack:
        for server in servers:
            stack.callback(server.stop)
            server.start()
        for server in servers:
            server.wait_ready()
        yield list(servers)


@contextmanager
def fairgate_process(args: Sequence[str], port: int, log_path: Path | None = None) -> Iterator[str]:
    """``python -m fairgate ARGS`` (a server on ``port``) until the block ends; yields its base URL once
    ``/health`` answers."""
    with running([fairgate_server(args, port, log_path)]) as (server,):
        yield server.url


def environment(values: dict[str, str]) -> ExitStack:
    """Set ``values`` in this process's environment (inherited by the processes started meanwhile) until
    the returned stack is closed."""
    stack = ExitStack()
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)

    def restore() -> None:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    stack.callback(restore)
    return stack


__all__ = [
    "STARTUP_S_MAX",
    "ServerProcess",
    "descendants",
    "environment",
    "fairgate_process",
    "fairgate_server",
    "free_port",
    "health_probe",
    "running",
]
