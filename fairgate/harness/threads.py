"""An ASGI app served on a thread of this process: uvicorn on 127.0.0.1 with its own event loop, for a stack
whose servers share the caller's process (a test reaching into an app, a tapped replica)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fairgate.harness.process import STARTUP_S_MAX, free_port


@contextmanager
def serve_in_thread(app: Any, port: int | None = None) -> Iterator[str]:
    """Run the ASGI ``app`` under uvicorn on 127.0.0.1 (``port``, default a free one) until the block ends;
    yields its base URL (``http://127.0.0.1:<port>``).

    Raises:
        RuntimeError: the server did not start within ``STARTUP_S_MAX``.
    """
    import uvicorn

    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True, name=f"harness-{port}")
    thread.start()
    deadline = time.monotonic() + STARTUP_S_MAX
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            raise RuntimeError(f"a server did not start on port {port}")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


__all__ = ["serve_in_thread"]
