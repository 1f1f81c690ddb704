"""Limits are global, not per process: N processes racing on one tenant admit exactly the limit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fairgate.harness.ledger import drop_ledger
from fairgate.ledger import connect

SCRIPT = """
import asyncio, sys
from fairgate.ledger import QuotaExceeded, connect
async def main():
    ledger = await connect(sys.argv[1], sys.argv[2])
    admitted = 0
    for i in range(10):
        try:
            await ledger.reserve("t", f"{sys.argv[3]}-{i}", 1, 1, 0.0)
            admitted += 1
        except QuotaExceeded:
            pass
    await ledger.close()
    print(admitted)
asyncio.run(main())
"""


async def test_four_processes_share_one_concurrency_limit(backend, backend_url, tmp_path):
    url = backend_url(backend)
    quotas = tmp_path / "q.toml"
    quotas.write_text("[tenants.t]\nlimits = { max_concurrent = 7 }\n")
    ledger = await connect(url, str(quotas))
    env_path = str(Path(__file__).resolve().parents[2])
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, url, str(quotas), f"p{i}"],
            stdout=subprocess.PIPE,
            text=True,
            env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
        )
        for i in range(4)
    ]
    admitted = [int(p.communicate(timeout=120)[0].strip()) for p in processes]
    assert sum(admitted) == 7  # not 4 x 7
    assert len(await ledger.reservations("t", "open")) == 7
    await drop_ledger(ledger)
    await ledger.close()
