"""The floor under the gateway's overhead: the same HTTP stack (FastAPI on uvicorn with uvloop and httptools, a
pooled aiohttp session upstream) relaying ``POST /v1/completions`` with nothing of fairgate's (no key check,
ledger, queue, policy, meter, metrics or logs). A streamed request is relayed a read at a time, as the
upstream's bytes come (the least a relay that meters each token as it comes can do: one write to the client per
read). ``POST /collect/v1/completions`` serves a request that is not streamed as a relay that meters must: the
upstream asked to stream (a meter sees each token as it comes) and each event parsed (its text counted and
kept), the text joined into one completion document; the plain route asks the upstream for one JSON reply,
which no meter can see into. ``bench/gateway_overhead.py`` runs it as its own process in front of the same
replica, so the gateway's CPU per request and per relayed token can be read against what its stack alone costs on
the same machine, in the same run.

Usage: .venv/bin/python bench/bare_relay.py UPSTREAM_BASE_URL PORT
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse


def relay_app(upstream: str) -> FastAPI:
    """An app relaying ``POST /v1/completions`` to ``upstream`` unchanged: a JSON reply whole, a stream (``"stream":
    true``) one upstream read at a time; and ``POST /collect/v1/completions``, a JSON reply collected from a stream
    (see the module's docstring)."""
    app = FastAPI()
    sessions: list[aiohttp.ClientSession] = []

    async def begun(request: Request) -> tuple[aiohttp.ClientSession, dict[str, Any], dict[str, str]]:
        """The pooled session (made at the first request, on the server's loop), the body and the key to pass."""
        if not sessions:
            sessions.append(aiohttp.ClientSession())
        return sessions[0], await request.json(), {"Authorization": request.headers.get("authorization", "")}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        session, body, headers = await begun(request)
        if body.get("stream"):
            return StreamingResponse(lines(session, body, headers), media_type="text/event-stream")
        async with session.post(f"{upstream}/v1/completions", json=body, headers=headers) as reply:
            data = await reply.read()
        return Response(data, status_code=reply.status, media_type="application/json")

    @app.post("/collect/v1/completions")
    async def collected(request: Request) -> Response:
        session, body, headers = await begun(request)
        texts: list[str] = []
        last: dict[str, Any] = {}
        async with session.post(f"{upstream}/v1/completions", json={**body, "stream": True}, headers=headers) as reply:
            async for line in reply.content:  # one event line at a time
                if line.startswith(b"data: {"):
                    last = orjson.loads(line[6:])
                    texts += (choice.get("text") or "" for choice in last.get("choices") or ())
        choice = {"index": 0, "text": "".join(texts), "finish_reason": "length"}
        document = {"id": last.get("id"), "object": "text_completion", "model": last.get("model"), "choices": [choice]}
        return Response(orjson.dumps(document), media_type="application/json")

    async def lines(
        session: aiohttp.ClientSession, body: dict[str, object], headers: dict[str, str]
    ) -> AsyncIterator[bytes]:
        async with session.post(f"{upstream}/v1/completions", json=body, headers=headers) as reply:
            async for data in reply.content.iter_any():
                yield data

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def main() -> None:
    upstream, port = sys.argv[1].rstrip("/"), int(sys.argv[2])
    uvicorn.run(relay_app(upstream), host="127.0.0.1", port=port, loop="uvloop", http="httptools", log_level="warning")


if __name__ == "__main__":
    main()
