"""On-behalf-of tokens live at most ``[gateway].delegation_token_lifetime_max_s`` (default 24 h) from when they are
presented, and a payload with a key given twice is refused: in unit checks and over real HTTP."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from pathlib import Path

import pytest

from fairgate.emulator.api import create_app
from fairgate.gateway.app import create_gateway
from fairgate.gateway.auth import DelegationError, make_on_behalf_of, verify_on_behalf_of
from fairgate.gateway.config import GatewayConfigError, load_gateway_config
from fairgate.harness.threads import serve_in_thread
from tests.gateway.conftest import EMULATOR, post, write_config

SECRET = b"0123456789abcdef-delegation"
DAY_S = 86_400.0


def refusal(token: str, now_s: float, **limits: float) -> DelegationError:
    with pytest.raises(DelegationError) as caught:
        verify_on_behalf_of(SECRET, token, "batch", now_s, **limits)
    return caught.value


def test_a_token_may_live_a_day_by_default():
    now = 1_700_000_000.0
    assert verify_on_behalf_of(SECRET, make_on_behalf_of(SECRET, "batch", "chat", now + DAY_S), "batch", now) == "chat"
    error = refusal(make_on_behalf_of(SECRET, "batch", "chat", now + DAY_S + 1), now)
    assert error.reason == "lifetime_too_long"
    assert str(error) == "on-behalf-of token expires in 86,401 s; this gateway accepts at most 86,400 s"
    year = refusal(make_on_behalf_of(SECRET, "batch", "chat", now + 365 * DAY_S), now)
    assert year.reason == "lifetime_too_long"


def test_the_lifetime_bound_is_the_callers():
    now = 1_000.0
    token = make_on_behalf_of(SECRET, "batch", "chat", now + 120)
    assert refusal(token, now, lifetime_max_s=60.0).reason == "lifetime_too_long"
    assert verify_on_behalf_of(SECRET, token, "batch", now + 60, lifetime_max_s=60.0) == "chat"
    assert refusal(token, now + 120, lifetime_max_s=60.0).reason == "expired"


def signed_text(payload_json: str) -> str:
    payload = base64.urlsafe_b64encode(payload_json.encode()).rstrip(b"=").decode()
    signature = hmac.new(SECRET, payload.encode(), hashlib.sha256).digest()
    return f"{payload}.{base64.urlsafe_b64encode(signature).rstrip(b'=').decode()}"


@pytest.mark.parametrize(
    "payload, key",
    [
        ('{"d":"batch","exp":2000,"t":"chat","t":"agent","v":1}', "t"),
        ('{"d":"batch","d":"batch","exp":2000,"t":"chat","v":1}', "d"),
        ('{"d":"batch","exp":1,"exp":2000,"t":"chat","v":1}', "exp"),
    ],
)
def test_a_payload_with_a_key_twice_is_malformed(payload, key):
    error = refusal(signed_text(payload), 1_000.0)
    assert error.reason == "malformed"
    assert str(error) == f"on-behalf-of token is malformed: key {key!r} given twice in its payload"


def set_lifetime_max(path: Path, value: str) -> None:
    """Set ``[gateway].delegation_token_lifetime_max_s`` to the TOML ``value`` in the file at ``path``."""
    text = path.read_text()
    assert text.count("[gateway]\n") == 1
    path.write_text(text.replace("[gateway]\n", f"[gateway]\ndelegation_token_lifetime_max_s = {value}\n"))


def test_over_http_a_long_lived_token_is_refused_naming_the_setting(tmp_path, monkeypatch):
    secret = "s" * 32
    monkeypatch.setenv("FAIRGATE_DELEGATION_SECRET", secret)
    with serve_in_thread(create_app(EMULATOR)) as emulator:
        path, keys = write_config(tmp_path, [emulator], delegates=["gamma"])
        set_lifetime_max(path, "300")
        config = load_gateway_config(path)
        assert config.gateway.delegation_token_lifetime_max_s == 300.0
        with serve_in_thread(create_gateway(config)) as url:
            ok = make_on_behalf_of(secret.encode(), "gamma", "alpha", time.time() + 240)
            assert post(url, keys["gamma"], headers={"X-Fairgate-On-Behalf-Of": ok}).status_code == 200
            long = make_on_behalf_of(secret.encode(), "gamma", "alpha", time.time() + 3600)
            refused = post(url, keys["gamma"], headers={"X-Fairgate-On-Behalf-Of": long})
    assert refused.status_code == 403
    error = refused.json()["error"]
    assert error["code"] == "invalid_delegation"
    assert "expires in 3,6" in error["message"] and "accepts at most 300 s" in error["message"]


@pytest.mark.parametrize(
    "value, problem",
    [
        ("0", "Input should be greater than 0"),
        ("-5", "Input should be greater than 0"),
        ('"1d"', "Input should be a valid number"),
        ("nan", "Input should be a finite number"),
        ("1e9", "Input should be less than or equal to 31536000"),
    ],
)
def test_a_bad_max_token_lifetime_names_the_key(tmp_path, value, problem):
    path, _ = write_config(tmp_path, ["http://127.0.0.1:9/v1"], delegates=["gamma"])
    set_lifetime_max(path, value)
    with pytest.raises(GatewayConfigError) as caught:
        load_gateway_config(path)
    assert str(caught.value) == f"{path}: gateway.delegation_token_lifetime_max_s: {problem}"
