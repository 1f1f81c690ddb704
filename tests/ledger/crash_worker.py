"""A client process for the concurrency and crash test: random mixed ledger operations with retries.

Usage: python crash_worker.py URL QUOTAS_TOML WORKER_ID OPERATIONS SEED

Request ids come from a small shared pool, and each id's arguments are a function of the id, so
several processes reserve the same ids (a client retry from another process) without conflicting.
Every call is retried at random with the same values, as a client that lost the answer would.
"""

from __future__ import annotations

import asyncio
import random
import sys
import zlib

from fairgate.ledger import LedgerError, QuotaExceeded, Usage, connect

TENANTS = ("t0", "t1", "t2", "t3")


def args_of(request_id: str) -> tuple[str, int, int, float]:
    h = zlib.crc32(request_id.encode())
    return TENANTS[h % len(TENANTS)], 50 + h % 400, 20 + (h >> 8) % 300, float(10 + (h >> 16) % 500)


async def main(url: str, quotas: str, worker: int, operations: int, seed: int) -> None:
    rng = random.Random(seed)
    ledger = await connect(url, quotas)
    mine: list = []  # open reservations this worker knows of
    for _ in range(operations):
        roll = rng.random()
        try:
            if roll < 0.45 or not mine:
                request_id = f"req-{rng.randrange(3000)}"
                tenant, input_tokens, max_output, estimate = args_of(request_id)
                try:
                    r = await ledger.reserve(tenant, request_id, input_tokens, max_output, estimate)
                    if rng.random() < 0.3:  # the answer was lost: retry the same call
                        await ledger.reserve(tenant, request_id, input_tokens, max_output, estimate)
                    if r.status == "open":
                        mine.append(r)
                except QuotaExceeded:
                    pass
            else:
                r = mine[rng.randrange(len(mine))]
                current = await ledger.get(r.id)
                if current.is_final:
                    mine.remove(r)
                    continue
                out = min(r.max_output_tokens, current.billed.output_tokens + rng.randrange(0, 60))
                gpu = current.billed.gpu_ms + rng.uniform(0, r.gpu_ms_estimate * 0.8)
                kind = rng.random()
                if kind < 0.4:
                    await ledger.settle(r.id, r.input_tokens, out, gpu)
                elif kind < 0.75:
                    for _ in range(2 if rng.random() < 0.3 else 1):  # retried final settle
                        await ledger.settle(r.id, r.input_tokens, out, gpu, final=True)
                    mine.remove(r)
                elif kind < 0.95:
                    await ledger.cancel(r.id, Usage(r.input_tokens, out, gpu))
                    mine.remove(r)
                else:
                    mine.remove(r)  # abandoned: the sweeper must expire it
        except LedgerError:
            pass  # ReservationFinal etc.: another process's retry got there first
    await ledger.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])))
