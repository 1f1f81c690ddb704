"""Real servers on loopback for tests and benches: an ASGI app under uvicorn in a background thread
(``serve``), or a ``python -m fairgate`` process (``fairgate_process``). The drills start their stacks with the
same functions; they live in the package (``fairgate.drills.stack``), which cannot import from tests."""

from __future__ import annotations

from fairgate.drills.stack import fairgate_process, free_port
from fairgate.drills.stack import serve_in_thread as serve

__all__ = ["fairgate_process", "free_port", "serve"]
