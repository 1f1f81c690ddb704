"""HTTP/1.1 written byte for byte on a socket: a request whose headers an HTTP client would refuse or
normalise (two ``Authorization`` headers of different case, a trailing space, an empty bearer)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlencode, urlsplit


async def raw_request(
    base_url: str,
    method: str,
    path: str,
    headers: Sequence[tuple[str, str]],
    params: Sequence[tuple[str, str]] = (),
    body: dict[str, Any] | None = None,
    timeout_s: float = 60.0,
) -> tuple[int, bytes]:
    """Send the request with its headers exactly as given (``connection: close``); returns (status, body).

    Raises:
        OSError / TimeoutError / ValueError: the connection failed, or the answer is not HTTP.
    """
    where = urlsplit(base_url)
    content = b"" if body is None else json.dumps(body).encode("utf-8")
    target = path + (f"?{urlencode(params)}" if params else "")
    lines = [f"{method} {target} HTTP/1.1", f"host: {where.netloc}", "connection: close"]
    lines += [f"{name}: {value}" for name, value in headers]
    if content:
        lines += ["content-type: application/json", f"content-length: {len(content)}"]
    reader, writer = await asyncio.open_connection(where.hostname, where.port)
    try:
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + content)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), timeout=timeout_s)
    finally:
        writer.close()
    head, _, rest = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, (_dechunk(rest) if b"transfer-encoding: chunked" in head.lower() else rest)


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out, data = out + data[:size], data[size + 2 :]
    return out


__all__ = ["raw_request"]
