"""``fairgate explain`` and ``fairgate report`` as a user runs them: a request log written by a real gateway
in front of an emulated replica, then the commands in a subprocess (output, files, exit codes, messages)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fairgate.ledger.base import tenant_tag
from fairgate.ledger.config import LimitsConfig
from tests.conftest import fairgate
from tests.gateway.conftest import TENANTS, post, post_at_once, serve_stack

REPO = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[Path, Path]:  # type: ignore[no-untyped-def]
    """(gateway config, its request log) after: ok-1 served for alpha, beta's rate-2 refused (429 rate),
    gamma's flood of 7 with max_queued 1 (some queue_full), one bad key."""
    tmp = tmp_path_factory.mktemp("ops")
    with serve_stack(
        tmp,
        defaults=LimitsConfig(max_queued=1),
        limits={"beta": LimitsConfig(requests_per_minute=60, requests_burst=1)},
    ) as stack:
        url, keys = stack.url, stack.keys

        def status(tenant_key: str, request_id: str) -> int:
            body = {"model": "emu", "prompt": "a b c", "max_tokens": 6, "ignore_eos": True}
            return post(url, tenant_key, body, {"X-Request-Id": request_id}, timeout=60).status_code

        assert status(keys["alpha"], "ok-1") == 200
        assert status(keys["beta"], "rate-1") == 200
        assert status(keys["beta"], "rate-2") == 429
        assert status("fg-not-a-key", "nokey-1") == 401
        body = {"model": "emu", "prompt": "x", "max_tokens": 40, "ignore_eos": True}
        replies = post_at_once([(url, keys["gamma"], body, {"X-Request-Id": f"flood-{i}"}) for i in range(7)])
        assert sorted(r.status_code for r in replies) == [200] * 5 + [429] * 2
    assert stack.config.event_log_path is not None and stack.config.event_log_path.is_file()
    return stack.config_path, stack.config.event_log_path


def queue_full_id(log: Path) -> str:
    for line in log.read_text().splitlines():
        record = json.loads(line)
        if record.get("reason") == "queue_full":
            return str(record["request_id"])
    raise AssertionError("no queue_full rejection in the log")


def test_explain_a_served_request(served):
    config, log = served
    done = fairgate("explain", "ok-1", "--log", str(log))
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert f"Request ok-1 from tenant {tenant_tag('alpha')}, model emu:" in text
    assert "admitted: reserved 3 prompt tokens, up to 6 output tokens" in text
    assert "dispatched to upstream emu-0 after" in text and "in the tenant's queue" in text
    assert "finished (completed): 3 prompt + 6 output tokens (up to 6 allowed)" in text and "GPU ms billed" in text
    assert "In short: completed in" in text
    assert "alpha" not in text.replace(tenant_tag("alpha"), "")  # only the hash without the config
    named = fairgate("explain", "ok-1", "--config", str(config))
    assert named.returncode == 0 and f"tenant {tenant_tag('alpha')} (alpha)" in named.stdout


def test_explain_rejections_say_why_and_what_to_do(served):
    config, log = served
    rate = fairgate("explain", "rate-2", "--config", str(config))
    assert rate.returncode == 0, rate.stderr
    assert "rejected with HTTP 429 (rate: requests_per_minute)" in rate.stdout
    assert "why: the tenant had used up its requests-per-minute allowance" in rate.stdout
    assert "retry after:" in rate.stdout and "what to do:" in rate.stdout
    full = fairgate("explain", queue_full_id(log), "--log", str(log))
    assert full.returncode == 0, full.stderr
    assert "admitted: reserved" in full.stdout and "rejected after admission with HTTP 429 (queue_full)" in full.stdout
    assert "max_queued" in full.stdout and "nothing was billed" in full.stdout
    nokey = fairgate("explain", "nokey-1", "--log", str(log))
    assert nokey.returncode == 0 and "from an unidentified caller" in nokey.stdout and "HTTP 401" in nokey.stdout


def test_explain_an_unknown_request_exits_1(served):
    _, log = served
    done = fairgate("explain", "never-sent", "--log", str(log))
    assert done.returncode == 1 and done.stdout == ""
    assert "'never-sent' is not in" in done.stderr and str(log) in done.stderr


def test_a_bad_line_is_named_and_exits_2(served, tmp_path):
    _, log = served
    lines = log.read_text().splitlines()
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join([*lines[:4], '{"v": 1, "event": "finished", "ts": 5', *lines[4:]]) + "\n")
    for args in (["explain", "ok-1"], ["report", "--out", str(tmp_path / "out")]):
        done = fairgate(*args, "--log", str(broken))
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith(f"error: {broken}:5: not a JSON record") and "Traceback" not in done.stderr
    mistyped = tmp_path / "mistyped.jsonl"
    mistyped.write_text(
        lines[0] + '\n{"v":1,"event":"dispatched","ts":1.5,"request_id":"x","tenant_hash":null,'
        '"delegate_hash":null,"model":"emu","upstream":"u","queue_ms":"slow"}\n'
    )
    done = fairgate("explain", "x", "--log", str(mistyped))
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"error: {mistyped}:2: dispatched record: key 'queue_ms': expected a number, found \"slow\""
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--log", "{tmp}/none.jsonl"], "{tmp}/none.jsonl: file not found"),
        ([], "give --log PATH (the request log) or --config FILE"),
        (["--log", "{tmp}/none.jsonl", "--config", "{tmp}/x.toml"], "give --log PATH or --config FILE, not both"),
        (["--config", "{tmp}/x.toml"], "{tmp}/x.toml"),
    ],
)
def test_bad_options_exit_2(tmp_path, args, message):
    args = [a.format(tmp=tmp_path) for a in args]
    for command in (["explain", "ok-1"], ["report", "--out", str(tmp_path / "out")]):
        done = fairgate(*command, *args)
        assert done.returncode == 2 and message.format(tmp=tmp_path) in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def test_report_writes_charts_and_a_page_naming_each_tenant_hash(served, tmp_path):
    _, log = served
    out = tmp_path / "report"
    done = fairgate("report", "--log", str(log), "--out", str(out))
    assert done.returncode == 0, done.stderr
    names = {"shares.png", "queue_times.png", "rejections.png", "report.html"}
    assert {p.name for p in out.iterdir()} == names
    for name in names - {"report.html"}:
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5_000
        assert f"wrote {out / name}" in done.stderr
    page = (out / "report.html").read_text()
    for tenant in TENANTS:
        assert tenant_tag(tenant) in page and tenant not in page.replace(tenant_tag(tenant), "")
    for chart in ("shares.png", "queue_times.png", "rejections.png"):
        assert f'<img src="{chart}"' in page
    assert "<td>queue_full</td>" in page and "<td>rate</td>" in page and "<td>auth</td>" in page
    assert "policy gpu_fair" in page


def test_report_with_the_config_names_tenants(served, tmp_path):
    config, _ = served
    done = fairgate("report", "--config", str(config), "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    page = (tmp_path / "report.html").read_text()
    assert f"<code>{tenant_tag('gamma')}</code> gamma" in page


def test_report_refuses_an_empty_log_and_a_file_as_out(served, tmp_path):
    _, log = served
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    done = fairgate("report", "--log", str(empty), "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and f"{empty}: the log holds no records" in done.stderr
    done = fairgate("report", "--log", str(log), "--out", str(empty))
    assert done.returncode == 2 and f"--out {empty}: exists and is not a directory" in done.stderr


def test_report_takes_shares_from_usage_aggregates_when_the_log_has_them(tmp_path):
    a, b = tenant_tag("alpha"), tenant_tag("beta")
    log = tmp_path / "events.jsonl"
    lines = [
        {
            "v": 1,
            "event": "started",
            "ts": 100.0,
            "pid": 1,
            "policy": "vtc",
            "tenants": {a: {"weight": 1.0, "priority": "interactive"}, b: {"weight": 2.0, "priority": "batch"}},
        }
    ]
    for k in range(1, 4):  # 100 and 40 GPU ms per 5 s
        lines.append(
            {
                "v": 1,
                "event": "usage",
                "ts": 100.0 + 5 * k,
                "since": 95.0 + 5 * k,
                "model": "m",
                "gpu_ms": {a: 100.0, b: 40.0},
            }
        )
    lines.append(
        {
            "v": 1,
            "event": "finished",
            "ts": 114.0,
            "request_id": "r",
            "tenant_hash": a,
            "delegate_hash": None,
            "model": "m",
            "upstream": "u",
            "outcome": "completed",
            "queue_ms": 3.0,
            "ttft_ms": 9.0,
            "tpot_ms": None,
            "input_tokens": 5,
            "output_tokens": 1,
            "gpu_ms": 7.0,
            "gpu_ms_estimate": 9.0,
            "max_output_tokens": 4,
        }
    )
    lines.append({"v": 1, "event": "later-kind", "ts": 116.0})  # unknown kinds are skipped
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = fairgate("report", "--log", str(log), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    page = (tmp_path / "out" / "report.html").read_text()
    assert "from the gateway&#x27;s metered usage aggregates" in page and "policy vtc" in page
    limited = " <em>(demand-limited)</em>"  # no request of either waited for a slot (none was dispatched)
    assert (
        f"<td><code>{a}</code>{limited}</td><td>0</td><td>1 completed</td><td>0</td><td>300.0</td><td>71.4</td>" in page
    )
    assert (
        f"<td><code>{b}</code>{limited}</td><td>0</td><td>0</td><td>0</td><td>120.0</td><td>28.6</td><td>2.00</td>"
        in page
    )
    assert "waited for slots - (all tenants: 5.00)" in page  # (300/1) / (120/2); none backlogged
    assert "<td>12.0</td><td>12.0</td>" in page  # TTFT p50 / p99: 3 ms queued + 9 ms to the first token
    assert (tmp_path / "out" / "shares.png").read_bytes().startswith(PNG)
    assert (tmp_path / "out" / "rejections.png").read_bytes().startswith(PNG)  # "no request was rejected"


def test_report_marks_demand_limited_tenants_and_heads_with_the_backlogged_ones(tmp_path):
    """Found by a new user: the report headlined max/min 854 because one tenant sent 4 requests. The headline
    is now over the tenants that waited for slots; a tenant that never did is marked demand-limited."""
    a, b, c = tenant_tag("alpha"), tenant_tag("beta"), tenant_tag("gamma")
    weights = {t: {"weight": 1.0, "priority": "interactive"} for t in (a, b, c)}
    lines = [{"v": 1, "event": "started", "ts": 100.0, "pid": 1, "policy": "gpu_fair", "tenants": weights}]
    usage = {"v": 1, "event": "usage", "ts": 110.0, "since": 100.0, "model": "m"}
    lines.append(usage | {"gpu_ms": {a: 250.0, b: 200.0, c: 0.5}})  # two aggregates: the report plots from them
    lines.append(usage | {"ts": 120.0, "since": 110.0, "gpu_ms": {a: 250.0, b: 200.0, c: 0.5}})
    for i, (tenant, queue_ms) in enumerate([(a, 250.0), (b, 120.0), (c, 0.4), (c, 2.0)]):
        lines.append(
            {
                "v": 1,
                "event": "dispatched",
                "ts": 101.0 + i,
                "request_id": f"r{i}",
                "tenant_hash": tenant,
                "delegate_hash": None,
                "model": "m",
                "upstream": "u",
                "queue_ms": queue_ms,
            }
        )
    log = tmp_path / "events.jsonl"
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = fairgate("report", "--log", str(log), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    page = (tmp_path / "out" / "report.html").read_text()
    assert "waited for slots 1.25 (all tenants: 500.00)" in page  # 500/400 among alpha and beta; 500/1 over all
    assert f"<code>{c}</code> <em>(demand-limited)</em>" in page
    assert f"<code>{a}</code></td>" in page and f"<code>{b}</code></td>" in page
