"""The gateway keeps its connections to an upstream open between requests (it reads every answer to its end),
and a request whose kept-alive connection the upstream closed as it was reused is sent once more, on a new
connection, and runs once. The gateway reaches the emulated replica through a loopback TCP proxy that counts
the connections it accepts and can swallow the next request sent on one of them."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

import httpx

from fairgate.emulator.api import create_app
from fairgate.gateway.app import create_gateway
from fairgate.gateway.config import load_gateway_config
from fairgate.harness.proxy import CuttableProxy
from fairgate.harness.threads import serve_in_thread
from tests.gateway.conftest import BODY, EMULATOR, ledger_call, post, write_config

STREAMED = dict(BODY, max_tokens=8, stream=True)


@contextmanager
def proxy_to(url: str) -> Iterator[CuttableProxy]:
    """A ``CuttableProxy`` to ``url``'s host and port, run on an event loop of its own thread."""
    parts = urlparse(url)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="proxy")
    thread.start()
    proxy = asyncio.run_coroutine_threadsafe(CuttableProxy(parts.hostname or "", parts.port or 80).start(), loop)
    started = proxy.result(10)
    try:
        yield started
    finally:
        asyncio.run_coroutine_threadsafe(started.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def tokens_received(reply: httpx.Response) -> int:
    chunks = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
    return sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"])


def calls_opened(proxy: CuttableProxy) -> int:
    """Connections the gateway opened with a completion call (not with a GET of the engine's /metrics)."""
    return sum(1 for line in proxy.opened_by if line.startswith("POST /v1/completions"))


def test_streams_in_sequence_share_one_connection_and_a_dropped_reuse_is_sent_once_more(tmp_path: Path) -> None:
    with serve_in_thread(create_app(EMULATOR)) as emulator, proxy_to(emulator) as proxy:
        path, keys = write_config(tmp_path, [f"http://127.0.0.1:{proxy.port}"])
        config = load_gateway_config(path)
        with serve_in_thread(create_gateway(config)) as gateway:
            replies = [post(gateway, keys["alpha"], STREAMED) for _ in range(5)]
            kept = calls_opened(proxy)
            proxy.drop_next_request(b"POST")  # the upstream closes the kept-alive connection as the next request comes
            dropped = post(gateway, keys["alpha"], STREAMED, headers={"X-Request-Id": "reused-and-dropped"})
            after = calls_opened(proxy)
            stats = httpx.get(f"{emulator}/emulator/stats", timeout=10).json()
        rows = ledger_call(config, lambda ledger: ledger.reservations("alpha"))
    assert all(r.status_code == 200 and tokens_received(r) == 8 for r in replies), [r.text for r in replies]
    # Five streams, one connection; two at most: a stream's connection is back in the pool once the end of its
    # body is read, in a task of its own after [DONE], which the client's next request may overtake.
    assert kept <= 2, proxy.opened_by
    # The swallowed request was sent again on a new connection: the client got its whole answer, the replica
    # ran it once, the ledger billed it once.
    assert dropped.status_code == 200 and tokens_received(dropped) == 8, dropped.text
    assert after == kept + 1, proxy.opened_by
    assert stats["sequences_finished"] == 6 and stats["tokens_generated"] == 6 * 8, stats
    [row] = [r for r in rows if r.request_id == "reused-and-dropped"]
    assert (row.status, row.billed.output_tokens) == ("settled", 8)
