"""Two gateway processes' worth of apps on one ledger: the queue bound is global, not per process
(real HTTP, a real SQLite file shared by both; the ledger conformance suite holds PostgreSQL and Redis
to the same queue semantics)."""

from __future__ import annotations

from fairgate.emulator.api import create_app
from fairgate.gateway.app import create_gateway
from fairgate.gateway.config import load_gateway_config
from fairgate.gateway.observe import Rejected
from fairgate.harness.threads import serve_in_thread
from fairgate.ledger.config import LimitsConfig
from tests.gateway.conftest import EMULATOR, Recorder, post_at_once, write_config


def test_the_queue_bound_holds_across_gateway_processes(tmp_path):
    recorders = [Recorder(), Recorder()]
    with serve_in_thread(create_app(EMULATOR)) as emulator_one, serve_in_thread(create_app(EMULATOR)) as emulator_two:
        path_one, keys = write_config(tmp_path, [emulator_one], defaults=LimitsConfig(max_queued=1))
        path_two, _ = write_config(tmp_path, [emulator_two], defaults=LimitsConfig(max_queued=1), name="two.toml")
        configs = [load_gateway_config(path_one), load_gateway_config(path_two)]
        assert configs[0].ledger_url == configs[1].ledger_url  # one shared ledger
        with (
            serve_in_thread(create_gateway(configs[0], observers=[recorders[0]])) as one,
            serve_in_thread(create_gateway(configs[1], observers=[recorders[1]])) as two,
        ):
            body = {"model": "emu", "prompt": "x", "max_tokens": 80, "ignore_eos": True}
            codes = [r.status_code for r in post_at_once([(url, keys["alpha"], body, None) for url in (one, two)] * 6)]
    # Each gateway runs 4 at once (max_batch); of the 4 that must wait, the one queue place is global:
    # one waits, three are refused - a per-process bound would have let two wait.
    assert sorted(codes) == [200] * 9 + [429] * 3
    refused = [r for recorder in recorders for r in recorder.of(Rejected)]
    assert [r.reason for r in refused] == ["queue_full"] * 3
    # The ledger's global count refused at least one (the process's own bound may refuse the others first).
    assert any(r.dimension == "max_queued" for r in refused)
