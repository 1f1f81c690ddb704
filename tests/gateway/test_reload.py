"""Reloading keys without a restart (``fairgate.gateway.reload``) and the key lifecycle (``fairgate keys add |
revoke | rotate``, ``expires``): over real HTTP, with the real CLI editing the file, and ``SIGHUP`` to a real
``fairgate serve`` process. What a client received is compared with what the ledger billed where a request
runs across a reload."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.datastructures import Headers

from fairgate.emulator.api import create_app
from fairgate.gateway.config import load_gateway_config
from fairgate.gateway.identity import Identity
from fairgate.harness.process import free_port
from fairgate.harness.threads import serve_in_thread
from tests.conftest import REPO, fairgate
from tests.gateway.conftest import EMULATOR, Stack, serve_stack, write_config

ADMIN = f"fg-test-admin-{'a' * 24}"
BODY = {"model": "emu", "prompt": "a b", "max_tokens": 3, "ignore_eos": True}


def post(url: str, key: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions", json=body or BODY, headers={"Authorization": f"Bearer {key}"}, timeout=30
    )


def reload(stack: Stack) -> httpx.Response:
    return httpx.post(f"{stack.url}/admin/reload", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)


def add_key(config: Path, tenant: str, *more: str) -> str:
    done = fairgate("keys", "add", tenant, "--config", str(config), *more)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_key_added_works_after_a_reload_and_a_stream_in_flight_runs_to_its_end(tmp_path: Path) -> None:
    with serve_stack(tmp_path, admin_key=ADMIN) as stack:
        new = add_key(stack.config_path, "beta", "--name", "laptop")
        assert post(stack.url, new).status_code == 401  # not applied yet
        streamed: list[str] = []
        body = {**BODY, "max_tokens": 300, "stream": True}
        headers = {"Authorization": f"Bearer {stack.keys['alpha']}", "X-Request-Id": "across"}

        def stream() -> None:
            with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, headers=headers, timeout=30) as r:
                streamed.extend(line for line in r.iter_lines() if line.startswith("data: "))

        runner = threading.Thread(target=stream)
        runner.start()
        time.sleep(0.3)  # the stream is running (300 tokens at ~5 ms an iteration)
        answer = reload(stack)
        runner.join(30)
        assert answer.status_code == 200, answer.text
        assert answer.json() == {
            "applied": ["key", "admin", "delegation", "access", "quotas", "upstream"],
            "keys": 4,
            "admin_keys": 1,
            "tenants": 3,
            "not_applied": [],
            "upstreams_added": [],
            "upstreams_removed": [],
        }
        assert post(stack.url, new).status_code == 200 and post(stack.url, stack.keys["alpha"]).status_code == 200
        [across] = [r for r in stack.reservations() if r.request_id == "across"]
    chunks = [json.loads(line[6:]) for line in streamed if line.startswith("data: {")]
    tokens = sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"])
    assert streamed[-1] == "data: [DONE]" and tokens == 300 == across.billed.output_tokens
    assert across.status == "settled"


def test_revoke_rotate_and_a_refused_file_keep_the_running_keys_right(tmp_path: Path) -> None:
    with serve_stack(tmp_path, admin_key=ADMIN) as stack:
        path = stack.config_path
        first = add_key(path, "gamma", "--name", "ci")
        assert reload(stack).status_code == 200 and post(stack.url, first).status_code == 200
        rotated = fairgate("keys", "rotate", "--config", str(path), "--name", "ci", "--grace-hours", "0")
        assert rotated.returncode == 0, rotated.stderr
        second = rotated.stdout.strip()
        assert reload(stack).json()["keys"] == 4
        assert post(stack.url, first).status_code == 401 and post(stack.url, second).status_code == 200
        # A broken file is refused whole, with its one-line error; the keys in force stay in force.
        good = path.read_text()
        path.write_text(good + "\n[[key]\n")
        refused = reload(stack)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "config_invalid", refused.text
        assert str(path) in refused.json()["error"]["message"] and "\n" not in refused.json()["error"]["message"]
        assert post(stack.url, second).status_code == 200
        # A tenant gone from the file (renamed): refused, naming it; its reservations may be open.
        path.write_text(good.replace('"gamma"', '"delta"').replace("[quotas.tenants.gamma]", "[quotas.tenants.delta]"))
        unknown = reload(stack)
        assert unknown.status_code == 400 and "tenant 'gamma' is gone from the file" in unknown.text
        # Other tables changed: the keys apply, the rest is named for a restart.
        path.write_text(good.replace("default_max_tokens = 64", "default_max_tokens = 32"))
        revoked = fairgate("keys", "revoke", "--config", str(path), "--name", "ci")
        assert revoked.returncode == 0, revoked.stderr
        applied = reload(stack)
        assert applied.json()["not_applied"] == ["gateway"] and applied.json()["keys"] == 3
        assert post(stack.url, second).status_code == 401
        assert httpx.post(f"{stack.url}/admin/reload", headers={"Authorization": f"Bearer {second}"}).status_code == 401
        tenant_key = httpx.post(f"{stack.url}/admin/reload", headers={"Authorization": f"Bearer {stack.keys['alpha']}"})
        assert tenant_key.status_code == 403


def test_an_expired_key_is_refused_as_expired_from_the_moment_it_expires(tmp_path: Path) -> None:
    path, _ = write_config(tmp_path, ["http://127.0.0.1:9"])
    key = add_key(path, "alpha", "--expires-in-days", "1")
    config = load_gateway_config(path)
    [entry] = [k for k in config.keys if k.expires is not None]
    assert entry.created is not None and 86_399 <= entry.expires_s - entry.created.timestamp() <= 86_401
    now = [entry.expires_s - 1.0]
    identity = Identity(config, lambda: now[0])

    class Request:
        headers = Headers({"authorization": f"Bearer {key}"})

    assert identity.tenant_of(Request()).tenant == "alpha"  # type: ignore[arg-type]
    now[0] = entry.expires_s
    try:
        identity.tenant_of(Request())  # type: ignore[arg-type]
    except Exception as exc:
        assert "expired" in str(exc) and getattr(exc, "status", None) == 401
    else:
        raise AssertionError("an expired key was accepted")


def test_sighup_reloads_a_running_fairgate_serve(tmp_path: Path) -> None:
    with serve_in_thread(create_app(EMULATOR)) as emulator:
        path, keys = write_config(tmp_path, [emulator], admin_key=ADMIN)
        port = free_port()
        log = (tmp_path / "serve.log").open("w")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        argv = [sys.executable, "-m", "fairgate", "serve", "--config", str(path), "--port", str(port)]
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(url)
            new = add_key(path, "alpha", "--name", "hup")
            assert post(url, new).status_code == 401
            server.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 10
            while post(url, new).status_code != 200:
                assert time.monotonic() < deadline and server.poll() is None, (tmp_path / "serve.log").read_text()
                time.sleep(0.1)
            assert post(url, keys["beta"]).status_code == 200 and server.poll() is None
        finally:
            server.terminate()
            server.wait(30)
            log.close()
    lines = [
        json.loads(line) for line in (tmp_path / "serve.log").read_text().splitlines() if '"config_reloaded"' in line
    ]
    assert [(line["event"], line["keys"], line["not_applied"]) for line in lines] == [("config_reloaded", 4, [])]
    audited = [json.loads(line) for line in (tmp_path / "fairgate-audit.jsonl").read_text().splitlines()]
    assert [(r["action"], r["outcome"]) for r in audited] == [("key.add", "written"), ("config.reload", "applied")]
    assert audited[0]["actor"].startswith("cli:") and audited[1]["actor"] == "signal:SIGHUP"


def _wait_ready(url: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.1)


def test_a_reload_that_would_lock_everyone_out_or_break_delegation_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by an outside tester: a file caught half written (an editor writing in place, SIGHUP between
    its writes) was applied with no key at all, and a delegation secret too short was accepted by a reload,
    then answered every delegated request with a 500."""
    with serve_stack(tmp_path, admin_key=ADMIN) as stack:
        path = stack.config_path
        good = path.read_text()
        path.write_text(good.split("[[key]]")[0].split("[admin]")[0])  # the tables before the keys only
        refused = reload(stack)
        assert refused.status_code == 400 and "would lock every caller out" in refused.text
        assert post(stack.url, stack.keys["alpha"]).status_code == 200  # the running keys stay
        monkeypatch.setenv("FG_TEST_SHORT_SECRET", "abc")
        path.write_text(good + '\n[delegation]\nsecret_env = "FG_TEST_SHORT_SECRET"\n')
        short = reload(stack)
        assert short.status_code == 400 and "holds 3 bytes" in short.text, short.text
        path.write_text(good)
        assert reload(stack).status_code == 200
