"""The emulated replica's ``/v1/embeddings``: deterministic pseudo-random vectors, at the cost of a prompt.

An embeddings request is one sequence on the replica: it waits for a slot like any request, is prefilled
(all its inputs' tokens) in the iteration it joins and leaves at that iteration's end - so it takes one slot
and one iteration, charged by the charge rule like a prompt whose first token ends it (the replica counts
that step as one generated token in its stats). Vectors are a pure function of the input and the dimension:
each input's SHA-256 seeds a Gaussian draw of ``dimensions`` numbers scaled to unit length, so the same input
always gets the same vector (``dimensions`` at most the replica's configured ``embedding_dimensions``;
``encoding_format: base64`` packs them as little-endian float32, as OpenAI does). Usage reports
``prompt_tokens`` (words of each text, one per token id) and ``total_tokens``. A client that disconnects
stops the sequence; errors are 400s naming the field (``input``, ``dimensions``).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import math
import random
import struct
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from fairgate.api import EmbeddingRequest, count_embedding_tokens, count_tokens, error_body
from fairgate.emulator.replica import EmulatedReplica

__all__ = ["EmbeddingRequest", "serve", "vector"]


def vector(item: str | list[int], dimensions: int) -> list[float]:
    """The unit-length vector of one input (see module docstring)."""
    seed = hashlib.sha256(json.dumps([item, dimensions]).encode("utf-8")).digest()
    rng = random.Random(int.from_bytes(seed[:8], "big"))
    values = [rng.gauss(0.0, 1.0) for _ in range(dimensions)]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [v / norm for v in values]


def _encoded(values: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return values


def _invalid(message: str, param: str, code: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=400, content=error_body(message, "invalid_request_error", param, code))


async def serve(
    replica: EmulatedReplica, request: Request, body: EmbeddingRequest, dimensions_max: int, context: int
) -> Any:
    """Run ``body`` as one prefilled sequence on ``replica`` and answer its vectors (see module docstring)."""
    items = body.items()
    for index, item in enumerate(items):
        tokens = count_tokens(item) if isinstance(item, str) else len(item)
        if tokens > context:
            return _invalid(
                f"input {index} has {tokens} tokens; the context is {context}.", "input", "context_length_exceeded"
            )
    dimensions = body.dimensions or dimensions_max
    if dimensions > dimensions_max:
        return _invalid(f"dimensions: at most {dimensions_max} for this model, got {dimensions}.", "dimensions")
    prompt_tokens = count_embedding_tokens(body)
    salt = (body.model_extra or {}).get("cache_salt")
    seq = replica.submit(prompt_tokens, 1, salt if isinstance(salt, str) else None)
    done = asyncio.ensure_future(seq.events.get())
    try:
        while not done.done():
            if await request.is_disconnected():
                replica.cancel(seq)
                break
            await asyncio.wait([done], timeout=0.02)
    finally:
        replica.cancel(seq)  # a no-op once finished
        done.cancel()
    if not seq.finished:
        return JSONResponse(
            status_code=499, content=error_body("client closed the request", "invalid_request_error", None, "cancelled")
        )
    data = [
        {"object": "embedding", "index": index, "embedding": _encoded(vector(item, dimensions), body.encoding_format)}
        for index, item in enumerate(items)
    ]
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return {"object": "list", "data": data, "model": body.model, "usage": usage}
