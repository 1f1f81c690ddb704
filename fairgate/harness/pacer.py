"""Pacer sequences that spread emulated replicas' iteration boundaries evenly.

Emulated replicas with one cost model, started together and kept busy, iterate in lock-step for ever (their
clocks are exact), so all their slots free at the same instants, an artefact no real fleet has. Before the
gateway starts, each replica gets one endless sequence straight from the harness (not through the gateway:
neither the policy nor the ledger sees it), replica ``i`` at ``i / K`` of an iteration after replica 0; a
busy replica keeps the phase it started with. Each emulator needs one slot more than the gateway uses.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from fairgate.harness.process import STARTUP_S_MAX
from fairgate.harness.replica import ReplicaModel

PACER_PROMPT_TOKENS = 1


@contextmanager
def pace_replicas(replica: ReplicaModel, model: str, urls: list[str]) -> Iterator[None]:
    """Keep one endless sequence on each replica at ``urls`` (all with the cost model ``replica``, serving
    ``model``), replica ``i`` started ``i / K`` of an iteration after replica 0; stopped (the connections
    closed) when the block ends.

    Raises:
        RuntimeError: a pacer sequence did not get its first token.
    """
    import httpx

    loop = asyncio.new_event_loop()
    started = threading.Event()
    failure: list[BaseException] = []
    stop: asyncio.Future[None] = loop.create_future()

    async def pacer(url: str, http: httpx.AsyncClient, first_token: asyncio.Event) -> None:
        body = {
            "model": model,
            "prompt": "x",
            "max_tokens": replica.max_model_len - PACER_PROMPT_TOKENS - 1,
            "ignore_eos": True,
            "stream": True,
        }
        async with http.stream("POST", f"{url}/v1/completions", json=body) as reply:
            async for line in reply.aiter_lines():
                if line.startswith("data: {"):
                    first_token.set()

    async def main() -> None:
        try:
            async with httpx.AsyncClient(timeout=None) as http:
                tasks, first_tokens = [], []
                period_s = replica.iteration_ms(1) / 1000.0
                begin = time.monotonic()
                for i, url in enumerate(urls):
                    # An idle replica starts an iteration when a request arrives: replica i's iterations
                    # begin i/K of an iteration after replica 0's (and keep that phase while it is busy).
                    await asyncio.sleep(max(0.0, begin + period_s * i / len(urls) - time.monotonic()))
                    first_tokens.append(asyncio.Event())
                    tasks.append(asyncio.create_task(pacer(url, http, first_tokens[-1])))
                for event in first_tokens:
                    await asyncio.wait_for(event.wait(), STARTUP_S_MAX)
                started.set()
                await stop
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        except BaseException as exc:
            failure.append(exc)
            started.set()

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True, name="harness-pacer")
    thread.start()
    started.wait(STARTUP_S_MAX * (len(urls) + 1))
    try:
        if failure or not started.is_set():
            raise RuntimeError(f"could not start the replicas' pacer sequences: {failure[:1]}")
        yield
    finally:
        loop.call_soon_threadsafe(_resolve, stop)
        thread.join(timeout=30)
        loop.close()


def _resolve(stop: asyncio.Future[None]) -> None:
    if not stop.done():
        stop.set_result(None)


__all__ = ["pace_replicas"]
