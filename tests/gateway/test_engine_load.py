"""Engine-aware dispatch (fairgate.gateway.engine_load): the gateway reads the engine's own load from its
/metrics and sends nothing more to an engine that keeps requests queued inside itself."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from fairgate.emulator.api import create_app, replica_of
from fairgate.gateway import engine_load
from fairgate.gateway.engine_load import parse_load
from fairgate.gateway.kinds import KINDS
from fairgate.gateway.observe import Dispatched
from tests.gateway.conftest import REPLICA, serve_stack

VLLM_TEXT = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="a"} 3.0
vllm:num_requests_running{engine="1",model_name="a"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="a"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="a"} 0.5
"""
LLAMACPP_TEXT = """# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
"""


def test_the_load_series_of_each_kind_are_summed_over_their_labels():
    assert parse_load(VLLM_TEXT, KINDS["vllm"].metrics) == (5.0, 4.0)
    assert parse_load(LLAMACPP_TEXT, KINDS["llamacpp"].metrics) == (1.0, 0.0)
    assert parse_load(LLAMACPP_TEXT, KINDS["vllm"].metrics) == (None, None)  # not its series: unknown


class DispatchWatch:
    """Observes the gateway's events: the engine's queue at each dispatch."""

    def __init__(self) -> None:
        self.app: Any = None
        self.waiting_at_dispatch: list[int] = []

    def observe(self, event: Any) -> None:
        if isinstance(event, Dispatched):
            self.waiting_at_dispatch.append(replica_of(self.app).waiting)


async def _six_long_requests(url: str, key: str) -> list[int]:
    body = {"model": "emu", "prompt": "x", "max_tokens": 300, "ignore_eos": True}  # ~1.3 s each, alone
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        headers = {"Authorization": f"Bearer {key}"}
        replies = await asyncio.gather(*(http.post("/v1/completions", json=body, headers=headers) for _ in range(6)))
    return [r.status_code for r in replies]


@pytest.mark.slow
def test_an_engine_with_requests_queued_inside_gets_nothing_more_until_they_ran(tmp_path, monkeypatch):
    # The engine has one slot; the gateway is told four (a misconfigured max_batch): four requests go at
    # once, three of them wait inside the engine, first come first served. Two reads of its /metrics later
    # the gateway holds the fifth and sixth until the engine's queue is empty - without the engine's load
    # the fifth would go as soon as the first ended, behind two still queued in the engine.
    # Reads every 0.1 s: two of them well within the first request's ~0.85 s, however loaded the machine.
    monkeypatch.setattr(engine_load, "ENGINE_LOAD_EVERY_S", 0.1)
    one_slot = REPLICA.settings("emu").model_copy(update={"max_batch": 1})
    watch = DispatchWatch()
    watch.app = create_app(one_slot)
    with serve_stack(tmp_path, upstream=watch.app, observers=[watch]) as stack:
        codes = asyncio.run(_six_long_requests(stack.url, stack.keys["alpha"]))
    assert codes == [200] * 6
    assert len(watch.waiting_at_dispatch) == 6
    assert watch.waiting_at_dispatch[4:] == [0, 0], watch.waiting_at_dispatch  # not sent behind a queue


def test_only_a_full_engine_with_a_queue_on_two_reads_in_a_row_is_overfilled():
    from tests.gateway.test_dispatch import build

    dispatcher, [u, _] = build()
    for running, waiting in ((2, 0), (1, 1), (1, 1), (2, 1)):  # a request waits for the next iteration
        dispatcher.engine_load(u, running, waiting)
        assert not u.overfilled and u.takes()
    dispatcher.engine_load(u, 2, 1)  # full and a queue, twice in a row
    assert u.overfilled and not u.takes()
    assert (u.engine_running, u.engine_waiting, u.engine_running_max) == (2, 1, 2)
    dispatcher.engine_load(u, 2, 0)  # drained
    assert not u.overfilled and u.takes()
    dispatcher.engine_load(u, None, None)  # unreadable: unknown, no effect
    assert not u.overfilled and u.takes()
