"""Bad input around real engines gets a clear error and loses nothing: upstream keys that cannot be a
bearer token, CA bundles and header values the TLS or HTTP layer would fail on at start, embeddings fields
no engine gets, and ``fairgate calibrate`` options (checked before anything is probed; a table that cannot
be written is printed instead)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from fairgate.gateway.config import GatewayConfigError
from fairgate.gateway.credentials import CredentialError, header_problem, read_key
from tests.gateway.conftest import BODY, serve_stack, write_config


@pytest.mark.parametrize("key", ["sk-SECRET1\nsk-SECRET2", "sk-with SECRET", "sk-caf\u00e9SECRET", "\n\n"])
def test_a_key_that_cannot_be_a_bearer_token_is_refused_without_showing_it(key):
    with pytest.raises(CredentialError) as refused:
        read_key("UPSTREAM_KEY", None, {"UPSTREAM_KEY": key})
    assert "UPSTREAM_KEY" in str(refused.value)
    assert "SECRET" not in str(refused.value) and "sk-" not in str(refused.value)
    assert read_key("UPSTREAM_KEY", None, {"UPSTREAM_KEY": "sk-fine-123\n"}).get_secret_value() == "sk-fine-123"


def test_a_header_value_that_is_not_ascii_is_refused():
    assert header_problem("X-Team", "caf\u00e9") == "X-Team: its value is not ASCII"
    assert header_problem("X-Team", "ml") is None


def test_a_ca_file_without_a_certificate_stops_the_config_naming_it(tmp_path):
    (tmp_path / "ca.pem").write_text("not a certificate\n")
    with pytest.raises(GatewayConfigError) as refused:
        write_config(tmp_path, ["https://127.0.0.1:9"], upstream_table={"ca_file": "ca.pem"})
    assert "upstream[0].ca_file" in str(refused.value) and "no PEM certificate" in str(refused.value)
    # over plain http the bundle would never be used: refused too (here by the typed table the file is built from;
    # tests/gateway/test_upstream_kinds.py reads it from a file, naming upstream[0])
    with pytest.raises(ValueError, match=r"ca_file: a CA bundle is used only with an https:// url"):
        write_config(tmp_path, ["http://127.0.0.1:9"], upstream_table={"ca_file": "ca.pem"})


def test_an_embeddings_field_no_engine_gets_is_refused_naming_it(tmp_path):
    with serve_stack(tmp_path) as stack:
        headers = {"Authorization": f"Bearer {stack.keys['alpha']}"}
        body = {"model": "emu", "input": "hello", "truncate_prompt_tokens": 5}
        reply = httpx.post(f"{stack.url}/v1/embeddings", json=body, headers=headers, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "truncate_prompt_tokens"
        assert stack.reservations() == []
        assert httpx.post(f"{stack.url}/v1/completions", json=BODY, headers=headers, timeout=30).status_code == 200


def _calibrate(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "fairgate", "calibrate", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["http://127.0.0.1:99999"], "a port 1-65535"),
        (["http://"], "base URL"),
        (["http://127.0.0.1:1/v1/chat/completions"], "not an endpoint"),
        (["ftp://127.0.0.1:1"], "http://"),
        (["http://127.0.0.1:1", "--kind", "ollama"], "--kind 'ollama'"),
        (["http://127.0.0.1:1", "--name", "emu 0"], "--name 'emu 0'"),
        (["http://127.0.0.1:1", "--model", ""], "--model"),
        (["http://127.0.0.1:1", "--out", "/nonexistent-folder/x.toml"], "its folder does not exist"),
        (["http://127.0.0.1:1", "--api-key-env", "FG_TEST_UNSET_KEY"], "$FG_TEST_UNSET_KEY is empty"),
    ],
)
def test_calibrate_refuses_bad_options_before_probing(args, said):
    done = _calibrate(*args)
    assert done.returncode == 2, done.stderr
    assert said in done.stderr and "Traceback" not in done.stderr
    assert done.stderr.count("\n") <= 2


def test_calibrate_with_a_key_holding_a_line_break_shows_no_key(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "CAL_KEY": "sk-CALSECRET\nX-Evil: 1"}
    done = _calibrate("http://127.0.0.1:1", "--api-key-env", "CAL_KEY", env=env)
    assert done.returncode == 2 and "CALSECRET" not in done.stderr + done.stdout
    assert "outside visible ASCII" in done.stderr


def test_calibrate_of_an_engine_that_does_not_answer_says_so(tmp_path: Path):
    done = _calibrate("http://127.0.0.1:1", "--model", "m", "--max-batch", "2")
    assert done.returncode == 2 and "Traceback" not in done.stderr and done.stderr.count("\n") == 1
    assert "error: URL http://127.0.0.1:1/v1: cannot reach it (ConnectError)" in done.stderr
