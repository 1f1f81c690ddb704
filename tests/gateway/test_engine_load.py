"""Engine-aware dispatch (fairgate.gateway.engine_load): the gateway reads the engine's own load from its
/metrics and sends nothing more to an engine that keeps requests queued inside itself."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import pytest

from fairgate.emulator.api import create_app, replica_of
from fairgate.gateway import engine_load
from fairgate.gateway.engine_load import BatchCheck, disagree, parse_load
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


def test_a_batch_mismatch_is_declared_after_four_reads_in_a_row_and_ended_after_four_agreeing():
    check = BatchCheck()
    # A request sent and not yet admitted (engine 0 of 4) on one read, and differences within the tolerance
    # (max(2 sequences, 25 % of the larger)): no mismatch.
    for running, batch in ((0, 4), (4, 4), (6, 4), (10, 8), (3, 4), (0, 1), (None, 12), (12, 4), (12, 4), (4, 4)):
        assert check.read(running, batch) is None and not check.mismatched
    reads = [check.read(9, 4) for _ in range(4)]  # another client's five sequences, four reads in a row
    assert reads == [None, None, None, True] and check.mismatched
    assert check.read(4, 4) is None and check.read(None, 4) is None  # an unknown count breaks the run
    reads = [check.read(4, 4) for _ in range(4)]
    assert reads == [None, None, None, False] and not check.mismatched
    assert disagree(9, 4) and disagree(4, 9) and not disagree(10, 8) and disagree(40, 29) and not disagree(40, 30)


ADMIN_KEY = "fg-test-admin-" + "e" * 24


def _long(tokens: int) -> dict[str, Any]:
    return {"model": "emu", "prompt": "x", "max_tokens": tokens, "ignore_eos": True}


async def _mismatch_gauge(http: httpx.AsyncClient, gateway: str) -> float | None:
    text = (await http.get(f"{gateway}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})).text
    found = [
        x for x in text.splitlines() if x.startswith('fairgate_upstream_batch_mismatch{model="emu",upstream="emu-0"}')
    ]
    return float(found[0].rsplit(" ", 1)[1]) if found else None


async def _gauge_until(http: httpx.AsyncClient, gateway: str, value: float, within_s: float) -> list[float | None]:
    """The gauge read every 0.05 s until it is ``value`` or ``within_s`` passed: the values read."""
    loop = asyncio.get_running_loop()
    deadline, seen = loop.time() + within_s, [await _mismatch_gauge(http, gateway)]
    while seen[-1] != value and loop.time() < deadline:
        await asyncio.sleep(0.05)
        seen.append(await _mismatch_gauge(http, gateway))
    return seen


async def _alone_then_shared(gateway: str, key: str, engine: str) -> dict[str, Any]:
    """Four requests through the gateway at once (the engine runs what the gateway meters), then one through
    the gateway while a second client sends four straight to the engine: the gauge's values in each phase,
    and the warnings logged by the end of the first."""
    seen: dict[str, Any] = {}
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=60) as http:

        def ours(tokens: int) -> Any:
            return http.post(f"{gateway}/v1/completions", json=_long(tokens), headers=headers)

        replies = list(await asyncio.gather(*(ours(150) for _ in range(4))))
        seen["alone"] = await _mismatch_gauge(http, gateway)
        mine = asyncio.ensure_future(ours(400))  # ~2.1 s; theirs ~1.6 s
        theirs = [asyncio.ensure_future(http.post(f"{engine}/completions", json=_long(300))) for _ in range(4)]
        seen["shared"] = await _gauge_until(http, gateway, 1.0, within_s=1.5)
        replies += await asyncio.gather(mine, *theirs)
        seen["after"] = await _gauge_until(http, gateway, 0.0, within_s=5.0)
    seen["codes"] = [r.status_code for r in replies]
    return seen


@pytest.mark.slow
def test_a_second_client_on_the_engine_shows_as_a_batch_mismatch_until_it_stops(tmp_path, monkeypatch, caplog):
    # The engine has 8 slots; the gateway uses 4 of them and meters what it sends. A second client sending
    # straight to the engine is invisible to the meter: the engine runs 5 while the gateway's batch is 1, and
    # every dt / B share the meter books is five times what it should be.
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(engine_load, "ENGINE_LOAD_EVERY_S", 0.1)  # four reads within the shared ~1.6 s
    engine = create_app(REPLICA.settings("emu").model_copy(update={"max_batch": 8}))
    with serve_stack(tmp_path, upstream=engine, admin_key=ADMIN_KEY) as stack:
        engine_url = stack.config.upstreams[0].url
        seen = asyncio.run(_alone_then_shared(stack.url, stack.keys["alpha"], engine_url))
    lines = [json.loads(m) for m in caplog.messages if '"batch_size_mismatch' in m]
    assert seen["codes"] == [200] * 9
    assert seen["alone"] == 0.0  # the gateway alone: its batch is the engine's, to the lag of admission
    assert seen["shared"][-1] == 1.0 and seen["after"][-1] == 0.0, seen
    assert [line["event"] for line in lines] == ["batch_size_mismatch", "batch_size_mismatch_ended"], lines
    assert lines[0]["upstream"] == "emu-0" and (lines[0]["engine_running"], lines[0]["gateway_batch"]) == (5, 1)
    assert [r.levelname for r in caplog.records if '"batch_size_mismatch"' in r.getMessage()] == ["WARNING"]
