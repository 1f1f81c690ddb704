"""Rate-limit headers, agent-run headers, the request events observers receive, and upstream failures
before the first streamed byte - over real HTTP against a real emulator and SQLite ledger."""

from __future__ import annotations

import time

import pytest

from fairgate.emulator.api import create_app
from fairgate.gateway.app import create_gateway
from fairgate.gateway.config import load_gateway_config
from fairgate.gateway.observe import Admitted, Charged, Dispatched, Finished, Rejected
from fairgate.harness.process import free_port
from fairgate.harness.threads import serve_in_thread
from fairgate.ledger.config import LimitsConfig
from tests.gateway.conftest import BODY, EMULATOR, Recorder, ledger_call, post, serve_stack, write_config
from tests.gateway.test_headers import seconds_of


def test_remaining_and_reset_headers_count_down(tmp_path):
    with serve_stack(tmp_path, defaults=LimitsConfig(requests_per_minute=60, requests_burst=5)) as stack:
        url, keys = stack.url, stack.keys
        first, second = post(url, keys["alpha"]), post(url, keys["alpha"])
        assert first.headers["x-ratelimit-limit-requests"] == "60"
        assert first.headers["x-ratelimit-remaining-requests"] == "4"
        assert second.headers["x-ratelimit-remaining-requests"] == "3"
        # 60/min refills one request per second: up to 1 s (first) and 2 s (second) to be full again, less
        # the time between the reservation and the header (short, but a loaded machine stretches it).
        first_reset = seconds_of(first.headers["x-ratelimit-reset-requests"])
        second_reset = seconds_of(second.headers["x-ratelimit-reset-requests"])
        assert 0.5 <= first_reset <= 1.0 and 1.5 <= second_reset <= 2.0
        assert "x-ratelimit-remaining-tokens" not in first.headers  # no token limit configured
        for _ in range(3):
            post(url, keys["alpha"])
        refused = post(url, keys["alpha"])
        assert refused.status_code == 429
        assert refused.headers["x-fairgate-quota-dimension"] == "requests_per_minute"
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        assert refused.headers["x-ratelimit-limit-requests"] == "60"


def test_agent_run_limits_apply_per_run_id(tmp_path):
    recorder = Recorder()
    limits = LimitsConfig(max_model_calls=2, max_tool_rounds=1)
    with serve_stack(tmp_path, observers=[recorder], defaults=limits) as stack:
        url, keys = stack.url, stack.keys
        run = {"x-fairgate-run-id": "run-1"}
        assert [post(url, keys["alpha"], headers=run).status_code for _ in range(2)] == [200, 200]
        third = post(url, keys["alpha"], headers={**run, "x-request-id": "third"})
        assert third.status_code == 429 and third.headers["x-fairgate-quota-dimension"] == "max_model_calls"
        # Waiting never frees a run's calls: no Retry-After, and OpenAI's code for a spent quota.
        assert "retry-after" not in third.headers and third.json()["error"]["code"] == "insufficient_quota"
        assert post(url, keys["alpha"], headers={"x-fairgate-run-id": "run-2"}).status_code == 200
        assert post(url, keys["alpha"]).status_code == 200  # calls outside a run are not limited by it
        tool = {"x-fairgate-run-id": "run-3", "x-fairgate-tool-round": "1"}
        assert [post(url, keys["alpha"], headers=tool).status_code for _ in range(2)] == [200, 429]
        bad = post(url, keys["alpha"], headers={"x-fairgate-tool-round": "1"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-fairgate-tool-round"
        assert post(url, keys["alpha"], headers={"x-fairgate-tool-round": "maybe"}).status_code == 400
    [rejected] = recorder.of(Rejected, "third")
    expected = ("agent_run", "max_model_calls", "alpha", 429)
    assert (rejected.reason, rejected.dimension, rejected.tenant, rejected.status) == expected


def test_observers_see_each_request_from_admission_to_finish(tmp_path):
    recorder = Recorder()
    with serve_stack(tmp_path, observers=[recorder]) as stack:
        url, keys, config = stack.url, stack.keys, stack.config
        body = {"model": "emu", "prompt": "one two three", "max_tokens": 6, "ignore_eos": True}
        assert post(url, keys["beta"], body, {"x-request-id": "ok-1"}).status_code == 200
        assert post(url, "fg-wrong-key-" + "y" * 20, body, {"x-request-id": "bad-1"}).status_code == 401
        [reservation] = stack.ledger_call(lambda ledger: ledger.reservations("beta"))
        ledger_gpu_ms = reservation.billed.gpu_ms
    [admitted] = recorder.of(Admitted, "ok-1")
    [dispatched] = recorder.of(Dispatched, "ok-1")
    [finished] = recorder.of(Finished, "ok-1")
    assert (admitted.tenant, admitted.input_tokens, admitted.max_output_tokens) == ("beta", 3, 6)
    assert dispatched.upstream == "emu-0" and dispatched.queue_ms >= 0
    assert (finished.outcome, finished.input_tokens, finished.output_tokens) == ("completed", 3, 6)
    assert finished.gpu_ms == ledger_gpu_ms > 0  # the event carries what the ledger billed
    assert finished.ttft_ms is not None and finished.ttft_ms > 0 and finished.tpot_ms is not None
    # Six iterations of >= 4.25 ms (4 + 0.25 x B): the replica never runs ahead of its schedule, so the last
    # token comes >= 25.5 ms after dispatch (single gaps may be shorter when it catches up on a late wake-up).
    assert finished.tpot_ms > 0 and finished.ttft_ms + 5 * finished.tpot_ms >= 25.5
    assert finished.gpu_ms_estimate == admitted.gpu_ms_estimate and finished.max_output_tokens == 6
    charged = sum(e.gpu_ms for e in recorder.of(Charged) if e.tenant == "beta")
    # The policy was charged the prefill estimate up front, then what the meter found beyond it.
    assert abs(charged - finished.gpu_ms) <= config.upstreams[0].cost.prefill_ms(3) + 1e-6
    [unknown] = recorder.of(Rejected, "bad-1")
    assert (unknown.tenant, unknown.reason, unknown.status) == (None, "auth", 401)


def test_a_dead_upstream_is_taken_out_until_it_answers_again(tmp_path):
    port = free_port()
    path, keys = write_config(tmp_path, [f"http://127.0.0.1:{port}"])  # nothing listens there yet
    config = load_gateway_config(path)
    body = dict(BODY, stream=True)
    with serve_in_thread(create_gateway(config)) as url:
        # The first request finds the upstream refusing connections (502, before any byte of the stream);
        # the upstream is then out, so the next ones are refused at once (503) rather than tried again.
        replies = [post(url, keys["alpha"], body) for _ in range(6)]
        assert [r.status_code for r in replies] == [502] + [503] * 5
        assert replies[0].json()["error"]["code"] == "upstream_error"
        assert {r.json()["error"]["code"] for r in replies[1:]} == {"no_upstream"}
        assert all(1 <= int(r.headers["retry-after"]) <= 7 for r in replies[1:])
        reservations = ledger_call(config, lambda ledger: ledger.reservations("alpha"))
        assert [r.status for r in reservations] == ["cancelled"] * 6  # nothing held, nothing billed
        with serve_in_thread(create_app(EMULATOR), port=port):  # the replica comes up: the probe puts it back
            deadline = time.monotonic() + 10
            while (reply := post(url, keys["alpha"], BODY)).status_code == 503 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert reply.status_code == 200


@pytest.mark.parametrize("first_streams", [True, False])
def test_a_request_sent_to_an_upstream_that_refuses_it_goes_to_another_one(tmp_path, first_streams):
    """Found by the capacity drill: requests dispatched to a replica that had just died failed with 502 (one or
    two a tenant), though another replica was up. The upstream never saw them: they are queued again, under
    the same reservation, for another upstream."""
    recorder = Recorder()
    with serve_in_thread(create_app(EMULATOR)) as emulator:
        path, keys = write_config(tmp_path, [f"http://127.0.0.1:{free_port()}", emulator])  # the first is dead
        config = load_gateway_config(path)
        with serve_in_thread(create_gateway(config, observers=[recorder])) as url:
            streamed = post(url, keys["alpha"], dict(BODY, stream=first_streams), {"x-request-id": "s-1"})
            plain = post(url, keys["alpha"], BODY, {"x-request-id": "p-1"})
            later = post(url, keys["beta"], BODY, {"x-request-id": "p-2"})
            reservations = ledger_call(config, lambda ledger: ledger.reservations())
    billed = sorted((r.request_id, r.status, r.billed.output_tokens) for r in reservations)
    assert [streamed.status_code, plain.status_code, later.status_code] == [200, 200, 200], streamed.text
    if first_streams:
        assert streamed.text.rstrip().endswith("data: [DONE]")
    else:
        assert streamed.json()["usage"]["completion_tokens"] == 2
    assert plain.json()["usage"]["completion_tokens"] == 2
    # One reservation each, settled once, billed what ran on the live upstream.
    assert billed == [("p-1", "settled", 2), ("p-2", "settled", 2), ("s-1", "settled", 2)]
    # The first went to the dead upstream, which was then out: the others went to the live one at once.
    assert [d.upstream for d in recorder.of(Dispatched, "s-1")] == ["emu-0", "emu-1"]
    assert [d.upstream for d in recorder.of(Dispatched, "p-1")] == ["emu-1"]
    [finished] = recorder.of(Finished, "s-1")
    assert finished.outcome == "completed" and finished.output_tokens == 2


def test_the_liveness_sweep_keeps_running_requests_and_expires_abandoned_ones(tmp_path):
    slow = EMULATOR.model_copy(update={"iter_base_ms": 40.0})  # 60 tokens: about 2.5 s, past the 1-s TTL
    with serve_in_thread(create_app(slow)) as emulator:
        path, keys = write_config(tmp_path, [emulator], defaults=LimitsConfig(reservation_ttl_s=1), sweep_s=0.2)
        config = load_gateway_config(path)
        # As if reserved by a gateway process that was then killed:
        orphan = ledger_call(config, lambda ledger: ledger.reserve("beta", "orphan", 1, 10, 0.0)).id
        with serve_in_thread(create_gateway(config)) as url:
            long = post(url, keys["alpha"], {"model": "emu", "prompt": "x", "max_tokens": 60, "ignore_eos": True})
            assert long.status_code == 200 and long.json()["usage"]["completion_tokens"] == 60
            found = {r.request_id: r.status for r in ledger_call(config, lambda ledger: ledger.reservations())}
            found["orphan-id"] = ledger_call(config, lambda ledger: ledger.get(orphan)).status
    assert [s for r, s in found.items() if r not in ("orphan", "orphan-id")] == ["settled"]  # never expired
    assert found["orphan-id"] == "expired"
