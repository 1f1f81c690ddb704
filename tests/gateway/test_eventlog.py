"""The request log over real HTTP: known requests through gateway + emulated replica -> the JSON lines written.

One gateway run (module fixture) serves: a completed streamed request, a delegated one, a rate 429, a flood
that overflows the queue (queue_full), a bad key and a forbidden delegation (whose message names a tenant).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import httpx
import pytest

from fairgate.gateway.auth import make_on_behalf_of
from fairgate.gateway.eventlog import EventLog, EventLogError, read_records
from fairgate.gateway.observe import Admitted, Charged, Finished
from fairgate.ledger.base import tenant_tag
from fairgate.ledger.config import LimitsConfig
from tests.gateway import conftest
from tests.gateway.conftest import TENANTS, post_at_once, serve_stack

SECRET = "s" * 32
BODY = {"model": "emu", "prompt": "x y", "max_tokens": 6, "ignore_eos": True}


def post(url: str, key: str, request_id: str, headers: dict | None = None) -> httpx.Response:  # type: ignore[type-arg]
    return conftest.post(url, key, BODY, {"X-Request-Id": request_id, **(headers or {})}, timeout=60)


@pytest.fixture(scope="module")
def run(tmp_path_factory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("eventlog")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FAIRGATE_DELEGATION_SECRET", SECRET)
        statuses: dict[str, int] = {}
        with serve_stack(
            tmp,
            defaults=LimitsConfig(max_queued=1),
            limits={"gamma": LimitsConfig(requests_per_minute=60, requests_burst=1)},
            delegates=["gamma"],
        ) as stack:
            url, keys, config = stack.url, stack.keys, stack.config
            reply = conftest.post(url, keys["alpha"], {**BODY, "stream": True}, {"X-Request-Id": "ok-1"}, timeout=60)
            statuses["ok-1"] = reply.status_code
            token = make_on_behalf_of(SECRET.encode(), "gamma", "beta", time.time() + 60)
            statuses["deleg-1"] = post(
                url, keys["gamma"], "deleg-1", headers={"X-Fairgate-On-Behalf-Of": token}
            ).status_code
            statuses["rate-1"] = post(url, keys["gamma"], "rate-1").status_code
            limited = post(url, keys["gamma"], "rate-2")
            statuses["rate-2"] = limited.status_code
            statuses["nokey-1"] = post(url, "fg-wrong-key", "nokey-1").status_code
            statuses["forbid-1"] = post(
                url, keys["alpha"], "forbid-1", headers={"X-Fairgate-On-Behalf-Of": token}
            ).status_code

            ids = [f"flood-{i}" for i in range(8)]
            body = {**BODY, "max_tokens": 60}
            replies = post_at_once([(url, keys["alpha"], body, {"X-Request-Id": i}) for i in ids])
            statuses.update({i: r.status_code for i, r in zip(ids, replies, strict=False)})
        # the gateway and its replica have stopped: the log is flushed and closed
    assert config.event_log_path == tmp / "fairgate-events.jsonl"
    text = config.event_log_path.read_text()
    records = [record for _, _, record in read_records(config.event_log_path)]
    return statuses, records, text


def of(records: list[dict], request_id: str) -> list[dict]:  # type: ignore[type-arg]
    return [r for r in records if r.get("request_id") == request_id]


def test_a_completed_request_has_admitted_dispatched_finished(run):
    statuses, records, _ = run
    assert statuses["ok-1"] == 200
    admitted, dispatched, finished = of(records, "ok-1")
    assert [admitted["event"], dispatched["event"], finished["event"]] == ["admitted", "dispatched", "finished"]
    tag = tenant_tag("alpha")
    for record in (admitted, dispatched, finished):
        assert (record["tenant_hash"], record["delegate_hash"], record["model"], record["v"]) == (tag, None, "emu", 2)
        assert record["time"].endswith("Z") and abs(record["ts"] - time.time()) < 600
    assert (admitted["input_tokens"], admitted["max_output_tokens"]) == (2, 6) and admitted["gpu_ms_estimate"] > 0
    assert admitted["reservation_id"].startswith(tag)
    assert dispatched["upstream"] == "emu-0" and dispatched["queue_ms"] >= 0
    assert finished["outcome"] == "completed" and finished["upstream"] == "emu-0"
    assert (finished["input_tokens"], finished["output_tokens"], finished["max_output_tokens"]) == (2, 6, 6)
    assert finished["gpu_ms"] > 0 and finished["gpu_ms_estimate"] == admitted["gpu_ms_estimate"]
    assert (
        finished["first_token_after_dispatch_ms"] > 0
        and finished["tpot_ms"] > 0
        and finished["queue_ms"] == dispatched["queue_ms"]
    )
    assert finished["ttft_incl_queue_ms"] == round(finished["queue_ms"] + finished["first_token_after_dispatch_ms"], 3)
    assert admitted["ts"] <= dispatched["ts"] <= finished["ts"]


def test_a_delegated_request_carries_both_hashes(run):
    statuses, records, _ = run
    assert statuses["deleg-1"] == 200
    story = of(records, "deleg-1")
    assert [r["event"] for r in story] == ["admitted", "dispatched", "finished"]
    assert {(r["tenant_hash"], r["delegate_hash"]) for r in story} == {(tenant_tag("beta"), tenant_tag("gamma"))}


def test_a_rate_limited_request_is_rejected_with_its_dimension(run):
    statuses, records, _ = run
    assert (statuses["rate-1"], statuses["rate-2"]) == (200, 429)
    [rejected] = of(records, "rate-2")
    assert rejected["event"] == "rejected" and rejected["tenant_hash"] == tenant_tag("gamma")
    assert (rejected["reason"], rejected["status"], rejected["dimension"]) == ("rate", 429, "requests_per_minute")
    assert rejected["after_admission"] is False and "requests_per_minute" in rejected["message"]


def test_queue_full_rejections_follow_their_admission(run):
    statuses, records, _ = run
    flood = {i: s for i, s in statuses.items() if i.startswith("flood-")}
    assert sorted(flood.values()) == [200] * 5 + [429] * 3
    for request_id, status in flood.items():
        events = [r["event"] for r in of(records, request_id)]
        if status == 200:
            assert events == ["admitted", "dispatched", "finished"]
            assert of(records, request_id)[-1]["output_tokens"] == 60
        else:
            assert events == ["admitted", "rejected"]
            rejected = of(records, request_id)[1]
            assert (rejected["reason"], rejected["status"], rejected["after_admission"]) == ("queue_full", 429, True)
            assert rejected["tenant_hash"] == tenant_tag("alpha") and rejected["dimension"] is None
    queued = [of(records, i)[1]["queue_ms"] for i, s in flood.items() if s == 200]
    assert max(queued) > 10  # one waited for a slot


def test_auth_failures_are_logged_without_a_tenant_or_its_name(run):
    statuses, records, text = run
    assert (statuses["nokey-1"], statuses["forbid-1"]) == (401, 403)
    [nokey] = of(records, "nokey-1")
    assert (nokey["event"], nokey["reason"], nokey["status"], nokey["tenant_hash"]) == ("rejected", "auth", 401, None)
    [forbidden] = of(records, "forbid-1")
    assert (forbidden["reason"], forbidden["status"]) == ("auth", 403)
    # "Tenant 'alpha' may not act on behalf of others." is logged with the hash instead of the name
    assert f"tenant:{tenant_tag('alpha')}" in forbidden["message"]
    for name in TENANTS:
        assert name not in text


def test_gpu_time_is_logged_as_periodic_usage_not_per_token(run):
    _, records, _ = run
    kinds = [r["event"] for r in records]
    assert kinds[0] == "started" and kinds[-1] == "stopped" and "usage" in kinds
    assert records[0]["policy"] == "gpu_fair" and set(records[0]["tenants"]) == {tenant_tag(t) for t in TENANTS}
    usage: dict[str, float] = {}
    for record in records:
        if record["event"] == "usage":
            assert record["since"] <= record["ts"] and record["model"] == "emu"
            for tag, ms in record["gpu_ms"].items():
                usage[tag] = usage.get(tag, 0.0) + ms
    finished: dict[str, float] = {}
    for record in records:
        if record["event"] == "finished":
            finished[record["tenant_hash"]] = finished.get(record["tenant_hash"], 0.0) + record["gpu_ms"]
    assert set(usage) == set(finished) == {tenant_tag("alpha"), tenant_tag("beta"), tenant_tag("gamma")}
    for tag, ms in finished.items():
        assert ms * 0.95 <= usage[tag] <= ms * 1.5 + 1.0, (tag, ms, usage[tag])
    assert len(records) < 60  # one line per decision, not per token


def test_the_same_lines_go_to_the_gateway_logger(tmp_path, caplog):
    sink = EventLog(tmp_path / "events.jsonl", ["alpha"], flush_every_s=0.05)
    sink.start()
    with caplog.at_level(logging.INFO, logger="fairgate.gateway"):
        sink.observe(Admitted("r-1", "alpha", None, "m", "res-1", 3, 4, 5.5, 1_700_000_000.0))
        sink.observe(Charged("alpha", "m", 2.5, 1_700_000_000.5))
        sink.observe(
            Finished("r-1", "alpha", "m", "u", "completed", 1.0, 2.0, None, 3, 4, 2.5, 5.5, 4, 1_700_000_001.0)
        )
        sink.close()
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    logged = [r.getMessage() for r in caplog.records if r.name == "fairgate.gateway"]
    assert lines == logged and len(lines) == 4  # admitted, finished, usage, stopped
    admitted = json.loads(lines[0])
    assert admitted["time"] == "2023-11-14T22:13:20.000Z" and admitted["tenant_hash"] == tenant_tag("alpha")
    assert json.loads(lines[2])["gpu_ms"] == {tenant_tag("alpha"): 2.5}


def test_the_file_is_capped_and_rotated(tmp_path):
    path = tmp_path / "events.jsonl"
    sink = EventLog(path, [], max_bytes=2_000, backups=2)
    sink.start()
    for i in range(60):
        sink.observe(Admitted(f"r-{i}", "t", None, "m", "res", 1, 1, 1.0, 1_700_000_000.0 + i))
        assert sink.flush()  # one record per write
    sink.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["events.jsonl", "events.jsonl.1", "events.jsonl.2"]
    assert all(p.stat().st_size <= 2_000 for p in tmp_path.iterdir())
    ids = [r["request_id"] for _, _, r in read_records(path) if r["event"] == "admitted"]
    assert ids == sorted(ids, key=lambda i: int(i[2:])) and ids[-1] == "r-59"  # oldest file first, newest kept


def test_two_writers_share_one_file_and_its_rotation(tmp_path):
    path = tmp_path / "events.jsonl"
    sinks = [EventLog(path, [], max_bytes=2_500, backups=5) for _ in range(2)]
    for sink in sinks:
        sink.start()
    for i in range(40):
        sink = sinks[i % 2]
        sink.observe(Admitted(f"r-{i}", "t", None, "m", "res", 1, 1, 1.0, 1_700_000_000.0 + i))
        assert sink.flush()
    for sink in sinks:
        sink.close()
    assert all(p.stat().st_size <= 2_500 for p in tmp_path.iterdir()) and len(list(tmp_path.iterdir())) > 2
    ids = [r["request_id"] for _, _, r in read_records(path) if r["event"] == "admitted"]
    assert ids == [f"r-{i}" for i in range(40)]  # none lost, none twice, in order


def test_records_wait_at_most_a_second_and_flush_writes_at_once(tmp_path):
    path = tmp_path / "events.jsonl"
    sink = EventLog(path, [])
    sink.start()
    try:
        sink.observe(Admitted("r-1", "t", None, "m", "res", 1, 1, 1.0, 1_700_000_000.0))
        deadline = time.monotonic() + 1.0 + 2.0  # one flush interval, and slack for a slow machine
        while not (path.exists() and "r-1" in path.read_text()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        sink.observe(Admitted("r-2", "t", None, "m", "res", 1, 1, 1.0, 1_700_000_000.0))
        assert sink.flush() and "r-2" in path.read_text()
    finally:
        sink.close()
    assert path.read_text().splitlines()[-1].startswith('{"v":2,"event":"stopped"')


def test_a_version_1_finished_record_is_read_with_the_named_ttft_keys(tmp_path):
    path = tmp_path / "events.jsonl"
    keys = {"request_id": "r", "tenant_hash": None, "delegate_hash": None, "model": "m", "upstream": "u"}
    counts = {"input_tokens": 1, "output_tokens": 2, "gpu_ms": 3.0, "gpu_ms_estimate": 4.0, "max_output_tokens": 5}
    finished = {"v": 1, "event": "finished", "ts": 1.0, **keys, **counts, "outcome": "completed", "tpot_ms": None}
    lines = [{**finished, "queue_ms": 40.5, "ttft_ms": 9.25}, {**finished, "queue_ms": 3.0, "ttft_ms": None}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    read = [record for _, _, record in read_records(path)]
    assert [(r["ttft_incl_queue_ms"], r["first_token_after_dispatch_ms"]) for r in read] == [
        (49.75, 9.25),
        (None, None),
    ]
    path.write_text(json.dumps({**finished, "queue_ms": 1.0}) + "\n")
    with pytest.raises(EventLogError, match="finished record: key 'ttft_ms' is missing"):
        list(read_records(path))


def test_a_bad_line_is_named(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"v": 1, "event": "stopped", "ts": 1.0}\n\n{"v": 1, "event": "finished", "ts": 2.0}\nnope\n')
    with pytest.raises(EventLogError, match=rf"^{path}:3: finished record: key 'request_id' is missing$"):
        list(read_records(path))
    path.write_text('{"v": 1, "event": "later-kind", "ts": 1.0}\n{"v":1,"event":"dispatched"\n')
    with pytest.raises(EventLogError, match=rf"^{path}:2: not a JSON record"):
        list(read_records(path))
    with pytest.raises(EventLogError, match="file not found"):
        list(read_records(Path(tmp_path / "missing.jsonl")))


def test_records_are_formatted_in_the_writer_thread_and_a_bad_one_skips_only_itself(tmp_path, monkeypatch):
    sink = EventLog(tmp_path / "events.jsonl", ["alpha"], flush_every_s=0.05)
    formatted_on: list[str] = []
    record_of = sink.record_of

    def recording(event):  # type: ignore[no-untyped-def]
        formatted_on.append(threading.current_thread().name)
        return record_of(event)

    monkeypatch.setattr(sink, "record_of", recording)
    sink.start()
    sink.observe(Admitted("r-1", "alpha", None, "m", "res-1", 3, 4, 5.5, 1_700_000_000.0))
    assert formatted_on == []  # observe() only queued it
    sink.write({"v": 1, "event": "custom", "bad": object()})  # cannot be JSON: logged, skipped
    sink.observe(Admitted("r-2", "alpha", None, "m", "res-2", 3, 4, 5.5, 1_700_000_001.0))
    assert sink.flush()
    sink.close()
    assert formatted_on == ["fairgate-eventlog", "fairgate-eventlog"]
    records = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [r.get("request_id") for r in records if r["event"] == "admitted"] == ["r-1", "r-2"]
    assert "custom" not in {r["event"] for r in records}
