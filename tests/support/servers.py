"""Real HTTP servers on loopback for tests: an ASGI app under uvicorn in a background thread."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve(app: Any, port: int | None = None) -> Iterator[str]:
    """Run ``app`` on 127.0.0.1 until the block ends; yields its base URL (``http://127.0.0.1:PORT``)."""
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)


@contextmanager
def fairgate_process(args: list[str], port: int, startup_s: float = 30.0) -> Iterator[str]:
    """Run ``python -m fairgate ARGS`` (a server listening on ``port``) until the block ends; yields its
    base URL once ``/health`` answers."""
    import subprocess
    import sys

    import httpx

    child = subprocess.Popen([sys.executable, "-m", "fairgate", *args], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or child.poll() is not None:
                raise RuntimeError(f"fairgate {' '.join(args)} did not start")
            time.sleep(0.1)
        yield url
    finally:
        child.terminate()
        child.wait(timeout=30)
