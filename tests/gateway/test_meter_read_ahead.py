"""A stream whose relay waits for the ledger is billed what the replica spent, not the wait.

An outside tester's finding: the relay read the upstream itself, so while it awaited a partial settlement on a
ledger that did not answer (PostgreSQL refusing connections for 5 s), the tokens waited in the socket and the
meter stamped them - and the call's end - when the relay came back: the stream was billed 3.3x the GPU time the
replica spent. The upstream is now read in a task of its own (``fairgate.gateway.readahead``).

Here the SQLite ledger is locked by another process for ``LOCK_S`` while a lone stream runs (each partial
settlement waits the busy timeout, 2 s, and fails): the replica's own charge rule is the truth. The partial
settlements run beside the relay, so the tokens reach the client as the replica makes them."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from fairgate.harness.config import TenantSpec
from fairgate.harness.replica import ReplicaModel
from fairgate.harness.stack import ReplicaSpec, StackSpec, start_stack
from tests.ledger.test_sqlite_locked import locked

LOCK_S = 4.0
TOKENS = 100  # ~2.1 s on the replica below: the lock holds the relay past its end


def _spec() -> StackSpec:
    replica = ReplicaModel(iter_base_ms=20.0, iter_slope_ms=0.5, prefill_ms_per_token=0.05, max_batch=4)
    return StackSpec(tenants=(TenantSpec("alpha"),), replicas=(ReplicaSpec("emu", 1),), replica=replica, processes=True)


async def _stream(url: str, key: str, lock: threading.Event) -> tuple[int, float, float]:
    """One stream of ``TOKENS``; sets ``lock`` at its 20th token. Its tokens received, when the last of them
    came, and when the stream ended."""
    body = {"model": "emu", "prompt": "count", "max_tokens": TOKENS, "ignore_eos": True, "stream": True}
    received = 0
    async with (
        httpx.AsyncClient(timeout=60) as client,
        client.stream("POST", f"{url}/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}) as reply,
    ):
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            choices = json.loads(line[6:]).get("choices") if line.startswith("data: {") else None
            if choices and choices[0].get("text"):
                received += 1
                last_token_s = time.monotonic()
                if received == 20:
                    lock.set()
    return received, last_token_s, time.monotonic()


def test_a_stream_waiting_for_its_ledger_is_billed_the_replicas_time_not_the_wait() -> None:
    with start_stack(_spec()) as stack:
        lock, held = threading.Event(), threading.Event()

        def hold() -> None:
            lock.wait(30)
            with locked(stack.folder / "ledger.db", LOCK_S):
                held.set()
                time.sleep(LOCK_S)

        holder = threading.Thread(target=hold, daemon=True)
        holder.start()
        started = time.monotonic()
        received, last_token_s, ended = asyncio.run(_stream(stack.url, stack.keys["alpha"], lock))
        holder.join(30)
        truth = sum(asyncio.run(stack.replica_stats())[0].charge_ms_by_salt.values())
        billed = asyncio.run(stack.totals()).totals["alpha"].gpu_ms
    print(
        f"billed {billed:.0f} ms, replica {truth:.0f} ms, client {1000 * (ended - started):.0f} ms, "
        f"last token at {1000 * (last_token_s - started):.0f} ms"
    )
    assert held.is_set() and received == TOKENS
    # The tokens came as the replica made them: the partial settlements waited on the ledger beside the relay
    # (awaited, they held it a busy timeout each: the last token came ~4.5 s in). The stream's end waited for the
    # final settlement, which the client's usage and [DONE] follow.
    assert (last_token_s - started) * 1000.0 < truth + 1000.0
    assert (ended - started) * 1000.0 > truth + 1000.0
    # Billed as the replica spent it (the meter's tolerance on a lone stream), where the relay's own reads
    # billed the wait too (4,475 ms against 2,050 here).
    assert billed == pytest.approx(truth, rel=0.1), (billed, truth)
