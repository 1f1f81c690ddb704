"""Two gateway processes' worth of apps on one ledger: the queue bound is global, not per process
(real HTTP, a real SQLite file shared by both; the ledger conformance suite holds PostgreSQL and Redis
to the same queue semantics)."""

from __future__ import annotations

import asyncio

import httpx

from fairgate.emulator.api import create_app
from fairgate.gateway.app import create_gateway
from fairgate.gateway.config import load_gateway_config
from fairgate.gateway.observe import Rejected
from tests.gateway.conftest import EMULATOR, write_config
from tests.support.servers import serve


class Recorder:
    def __init__(self) -> None:
        self.rejected: list[Rejected] = []

    def observe(self, event: object) -> None:
        if isinstance(event, Rejected):
            self.rejected.append(event)


def test_the_queue_bound_holds_across_gateway_processes(tmp_path):
    recorders = [Recorder(), Recorder()]
    with serve(create_app(EMULATOR)) as emulator_one, serve(create_app(EMULATOR)) as emulator_two:
        path_one, keys = write_config(tmp_path, [emulator_one], defaults="max_queued = 1\n")
        text = path_one.read_text()
        path_two = tmp_path / "two.toml"
        path_two.write_text(text.replace(emulator_one, emulator_two))
        configs = [load_gateway_config(path_one), load_gateway_config(path_two)]
        assert configs[0].ledger_url == configs[1].ledger_url  # one shared ledger
        with (
            serve(create_gateway(configs[0], observers=[recorders[0]])) as one,
            serve(create_gateway(configs[1], observers=[recorders[1]])) as two,
        ):

            async def flood() -> list[int]:
                body = {"model": "emu", "prompt": "x", "max_tokens": 80, "ignore_eos": True}
                headers = {"Authorization": f"Bearer {keys['alpha']}"}
                async with httpx.AsyncClient(timeout=60) as http:
                    replies = await asyncio.gather(
                        *(
                            http.post(f"{url}/v1/completions", json=body, headers=headers)
                            for url in (one, two)
                            for _ in range(6)
                        )
                    )
                return [r.status_code for r in replies]

            codes = asyncio.run(flood())
    # Each gateway runs 4 at once (max_batch); of the 4 that must wait, the one queue place is global:
    # one waits, three are refused - a per-process bound would have let two wait.
    assert sorted(codes) == [200] * 9 + [429] * 3
    refused = [r for recorder in recorders for r in recorder.rejected]
    assert [r.reason for r in refused] == ["queue_full"] * 3
    # The ledger's global count refused at least one (the process's own bound may refuse the others first).
    assert any(r.dimension == "max_queued" for r in refused)
