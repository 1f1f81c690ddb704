"""Instructions a Redis shard executes per gateway request of the ledger: a throwaway redis-server run under
valgrind's cachegrind serves the pattern of ``bench/ledger_ops.py``'s server-time run (the gateway's: a reserve
that takes the run claim, then a final settle; ``--three-calls``: reserve, claim, final settle as three calls;
``BATCH`` requests open at once, one tenant) twice, for ``BASE`` requests and for ``BASE`` + ``--requests``; the
difference of the two totals over ``--requests`` leaves out starting the server and loading the scripts.

Unlike ``INFO commandstats`` µs, an instruction count reads alike however loaded the machine is (it counts the
server's work, not its cache misses or the other jobs on its cores): two versions of the scripts compare to a few
tenths of a percent on a shared machine where µs differ by tens of percent between runs.

Usage: .venv/bin/python bench/ledger_instructions.py [--requests 2000] [--repeat 2] [--three-calls]
       (needs valgrind and redis-server on PATH; Debian: apt-get install valgrind redis-server)
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fairgate.harness.ledger import bench_quotas
from fairgate.ledger import connect, quotas_from_dict

BASE = 250  # requests of the shorter run: one batch
BATCH = 250  # requests open at once, as in bench/ledger_ops.py
STARTUP_S_MAX = 60.0  # redis-server under valgrind starts in a few seconds


async def _requests(url: str, count: int, three_calls: bool) -> None:
    """``count`` gateway requests on one tenant, ``BATCH`` at a time: reserve them all with their run claims (or,
    ``three_calls``, reserve them all, then claim), then final settle."""
    ledger = await connect(f"{url}?prefix=fginstr{uuid.uuid4().hex[:8]}", quotas_from_dict(bench_quotas(1)))
    run = uuid.uuid4().hex[:8]
    owner = None if three_calls else "bench"
    try:
        for batch in range(count // BATCH):
            rs = [
                await ledger.reserve(
                    "bench0", f"{run}-{batch}-{i}", 100, 50, 10.0, claim_owner=owner, claim_lease_ms=6e4
                )
                for i in range(BATCH)
            ]
            for r in rs if three_calls else ():
                await ledger.claim(r.id, "bench", 60_000.0)
            for r in rs:
                await ledger.settle(r.id, 100, 20, 8.0, final=True)
    finally:
        await ledger.close()


def _wait_ready(client: Redis, server: subprocess.Popen[bytes], folder: Path) -> None:
    deadline = time.monotonic() + STARTUP_S_MAX
    while True:
        try:
            client.ping()
            return
        except RedisConnectionError:
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError(
                    f"redis-server under valgrind did not start (see {folder / 'valgrind.log'})"
                ) from None
            time.sleep(0.2)


def instructions(count: int, folder: Path, three_calls: bool) -> int:
    """Instructions (cachegrind's Ir) of a fresh redis-server from its start to its shutdown after ``count``
    gateway requests (``three_calls``: ``_requests``)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = folder / f"cachegrind.{count}.{port}"
    argv = ["valgrind", "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={out}"]
    argv += ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    with (folder / "valgrind.log").open("ab") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=log)
    client = Redis(port=port)
    try:
        _wait_ready(client, server, folder)
        asyncio.run(_requests(f"redis://127.0.0.1:{port}/0", count, three_calls))
        client.shutdown(nosave=True)
    except Exception:
        server.kill()
        raise
    finally:
        client.close()
        server.wait(timeout=STARTUP_S_MAX)
    summary = re.search(r"^summary:\s+(\d+)", out.read_text(), re.M)
    if summary is None:
        raise RuntimeError(f"no summary line in {out}")
    return int(summary.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000, help="requests the longer run adds (BATCH at a time)")
    parser.add_argument("--repeat", type=int, default=2, help="pairs of runs; each pair's figure is printed")
    parser.add_argument("--three-calls", action="store_true", help="reserve, claim, final settle as three calls")
    args = parser.parse_args()
    for tool in ("valgrind", "redis-server"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} not found on PATH")
    added = max(BATCH, args.requests // BATCH * BATCH)
    pattern = "reserve + claim + final settle" if args.three_calls else "reserve with its run claim + final settle"
    print(f"Redis server instructions per gateway request ({pattern}; {added:,} requests)")
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeat):
            counts = [instructions(n, Path(tmp), args.three_calls) for n in (BASE + added, BASE)]
            per_request = (counts[0] - counts[1]) / added
            print(f"  {per_request:,.0f} instructions")


if __name__ == "__main__":
    main()
