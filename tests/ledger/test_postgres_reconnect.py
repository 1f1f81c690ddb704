"""After a PostgreSQL stop, a gateway process's ledger answers again soon after the server does.

psycopg_pool retries a lost connection with a doubling delay (1, 2, 4, 8 s...): with its default
``reconnect_timeout`` (300 s) three pools took 3.5-4.2 s after a 10 s stop to answer again, and the fault matrix's
PostgreSQL ``ledger_stop`` cell lost usage: one process expired another's reservations (its hold after the outage
over) before that one could replay its journal. ``RECONNECT_TIMEOUT_S`` gives such an attempt up quickly, and the
next call connects at once."""

from __future__ import annotations

import asyncio
import time

import pytest

from fairgate.harness.postgres import throwaway_postgres_server
from fairgate.ledger import connect, quotas_from_dict
from fairgate.ledger.model import LedgerError
from fairgate.ledger.postgres import RECONNECT_TIMEOUT_S

DOWN_S = 10.0
POLL_S = 0.1


async def _answering(ledger: object, back: asyncio.Event) -> float:
    """When ``ledger`` first answers once ``back`` is set (it is asked every ``POLL_S`` meanwhile)."""
    while True:
        try:
            await ledger.account("t")  # type: ignore[attr-defined]
            if back.is_set():
                return time.monotonic()
        except LedgerError:
            pass
        await asyncio.sleep(POLL_S)


@pytest.mark.serial  # a server of its own stopped for 10 s: runs alone after the parallel part
def test_the_ledger_answers_soon_after_a_stopped_postgres_is_back() -> None:
    async def run() -> list[float]:
        with throwaway_postgres_server() as server:
            quotas = quotas_from_dict({"tenants": {"t": {}}})
            ledgers = [await connect(f"{server.url}?timeout_s=1", quotas) for _ in range(3)]
            try:
                for ledger in ledgers:
                    await ledger.account("t")
                await asyncio.to_thread(server.stop)
                back = asyncio.Event()
                polls = [asyncio.ensure_future(_answering(ledger, back)) for ledger in ledgers]
                await asyncio.sleep(DOWN_S)
                await asyncio.to_thread(lambda: server.start().wait_ready())
                back_s = time.monotonic()
                back.set()
                return [answered_s - back_s for answered_s in await asyncio.gather(*polls)]
            finally:
                for ledger in ledgers:
                    await ledger.close()

    delays_s = asyncio.run(run())
    # At most one given-up attempt's wait and a connect; psycopg_pool's doubling delays took 3.5-4.2 s here.
    assert max(delays_s) < RECONNECT_TIMEOUT_S + 1.0, delays_s
