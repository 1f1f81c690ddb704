"""API keys (hashing, the key ring), on-behalf-of tokens, and ``fairgate keys`` run as a user runs it."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
from pathlib import Path

import pytest

from fairgate.gateway.auth import (
    DelegationError,
    KeyRing,
    hash_api_key,
    is_key_hash,
    make_on_behalf_of,
    new_api_key,
    verify_api_key,
    verify_on_behalf_of,
)
from fairgate.gateway.config import load_gateway_config
from tests.conftest import fairgate

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "config" / "fairgate.example.toml"
SECRET = b"0123456789abcdef-delegation"


# --- API keys ---------------------------------------------------------------------------------------


def test_new_keys_are_prefixed_random_and_distinct() -> None:
    keys = {new_api_key() for _ in range(100)}
    assert len(keys) == 100
    assert all(re.fullmatch(r"fg-[A-Za-z0-9_-]{43}", key) for key in keys)


def test_hash_format_and_round_trip() -> None:
    key = new_api_key()
    stored = hash_api_key(key)
    algorithm, digest = stored.split("$")
    assert algorithm == "sha256" and digest == hashlib.sha256(key.encode()).hexdigest()
    assert is_key_hash(stored)
    assert verify_api_key(key, stored)
    salted = hash_api_key(key, bytes(16))
    algorithm, salt, digest = salted.split("$")
    assert algorithm == "sha256" and salt == bytes(16).hex()
    assert digest == hashlib.sha256(bytes(16) + key.encode()).hexdigest()
    assert is_key_hash(salted) and verify_api_key(key, salted)


def test_wrong_key_is_rejected() -> None:
    key = new_api_key()
    stored = hash_api_key(key)
    assert not verify_api_key(key + "x", stored)
    assert not verify_api_key(key[:-1], stored)
    assert not verify_api_key(new_api_key(), stored)
    assert not verify_api_key("", stored)
    assert not verify_api_key("x" * 10_000, stored)


def test_malformed_stored_hash_raises() -> None:
    for stored in ("", "sha256$$", "plain", "sha256$zz$" + "0" * 64, "md5$" + "00" * 16 + "$" + "0" * 64):
        assert not is_key_hash(stored)
        with pytest.raises(ValueError, match="sha256"):
            verify_api_key("fg-x", stored)
    with pytest.raises(ValueError):
        hash_api_key("")
    with pytest.raises(ValueError):
        hash_api_key("fg-x", b"short")


def test_key_ring_maps_keys_to_tenants() -> None:
    chat, chat_2, agent = new_api_key(), new_api_key(), new_api_key()
    ring = KeyRing([("chat", hash_api_key(chat)), ("agent", hash_api_key(agent)), ("chat", hash_api_key(chat_2))])
    assert len(ring) == 3
    for _ in range(2):  # the second round hits the cache
        assert ring.tenant_for(chat) == "chat"
        assert ring.tenant_for(chat_2) == "chat"
        assert ring.tenant_for(agent) == "agent"
        assert ring.tenant_for(new_api_key()) is None
        assert ring.tenant_for("") is None
        assert ring.tenant_for("x" * 100_000) is None


def test_key_ring_refuses_a_key_stored_for_two_tenants() -> None:
    key = new_api_key()
    ring = KeyRing([("chat", hash_api_key(key)), ("agent", hash_api_key(key))])
    assert ring.tenant_for(key) is None


def test_key_ring_rejects_malformed_hashes() -> None:
    with pytest.raises(ValueError, match="key hash #1"):
        KeyRing([("chat", hash_api_key("fg-a")), ("agent", "not-a-hash")])


# --- on-behalf-of tokens ------------------------------------------------------------------------------


def test_valid_token_names_the_tenant() -> None:
    token = make_on_behalf_of(SECRET, "batch", "chat", expires_at_s=1_000.0)
    assert verify_on_behalf_of(SECRET, token, "batch", now_s=999.0) == "chat"
    payload = json.loads(base64.urlsafe_b64decode(token.split(".")[0] + "=="))
    assert payload == {"d": "batch", "exp": 1000.0, "t": "chat", "v": 1}
    assert "=" not in token


def reason(token: str, delegate: str = "batch", now_s: float = 0.0, secret: bytes = SECRET) -> str:
    with pytest.raises(DelegationError) as caught:
        verify_on_behalf_of(secret, token, delegate, now_s)
    assert "\n" not in str(caught.value)
    return caught.value.reason


def test_expired_token() -> None:
    token = make_on_behalf_of(SECRET, "batch", "chat", expires_at_s=1_000.0)
    assert reason(token, now_s=1_000.0) == "expired"
    assert reason(token, now_s=5_000.0) == "expired"


def test_tampered_token() -> None:
    token = make_on_behalf_of(SECRET, "batch", "chat", expires_at_s=1_000.0)
    payload, signature = token.split(".")
    forged = (
        base64.urlsafe_b64encode(
            json.dumps(
                {"d": "batch", "exp": 1000.0, "t": "agent", "v": 1}, separators=(",", ":"), sort_keys=True
            ).encode()
        )
        .rstrip(b"=")
        .decode()
    )
    assert reason(f"{forged}.{signature}") == "bad_signature"
    flipped = signature[:-2] + ("A" if signature[-2] != "A" else "B") + signature[-1]
    assert reason(f"{payload}.{flipped}") == "bad_signature"
    assert reason(token, secret=b"another-secret-of-enough-bytes") == "bad_signature"


def test_wrong_delegate() -> None:
    token = make_on_behalf_of(SECRET, "batch", "chat", expires_at_s=1_000.0)
    assert reason(token, delegate="agent") == "wrong_delegate"


def signed(document: object) -> str:
    payload = base64.urlsafe_b64encode(json.dumps(document).encode()).rstrip(b"=").decode()
    signature = hmac.new(SECRET, payload.encode(), hashlib.sha256).digest()
    return f"{payload}.{base64.urlsafe_b64encode(signature).rstrip(b'=').decode()}"


@pytest.mark.parametrize(
    "token",
    [
        "",
        "abc",
        "a.b.c",
        "!!!.???",
        "a" * 5000,
        "abcde.fghij",
        signed([1, 2]),
        signed({"d": "batch", "t": "chat", "exp": 10}),
        signed({"d": "batch", "t": "", "exp": 10, "v": 1}),
        signed({"d": "batch", "t": "chat", "exp": "soon", "v": 1}),
        signed({"d": "batch", "t": "chat", "exp": 10, "v": 2}),
        signed({"d": "batch", "t": "chat", "exp": 10, "v": True}),
    ],
)
def test_malformed_token(token: str) -> None:
    assert reason(token) == "malformed"


def test_secrets_and_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        make_on_behalf_of(b"short", "batch", "chat", 1.0)
    with pytest.raises(ValueError, match="16 bytes"):
        verify_on_behalf_of(b"short", "a.b", "batch", 0.0)
    with pytest.raises(ValueError):
        make_on_behalf_of(SECRET, "", "chat", 1.0)
    with pytest.raises(ValueError):
        make_on_behalf_of(SECRET, "batch", "chat", float("inf"))


# --- fairgate keys ----------------------------------------------------------------------------------


def test_keys_add_and_list_end_to_end(tmp_path: Path) -> None:
    config = tmp_path / "fairgate.toml"
    config.write_text(EXAMPLE.read_text())
    comments = [line for line in config.read_text().splitlines() if line.lstrip().startswith("#")]

    added = fairgate("keys", "add", "chat", "--config", str(config), "--name", "ci")
    assert added.returncode == 0, added.stderr
    key = added.stdout.strip()
    assert re.fullmatch(r"fg-[A-Za-z0-9_-]{43}", key)
    assert "cannot be shown again" in added.stderr
    assert key not in added.stderr and key not in config.read_text()

    second = fairgate("keys", "add", "agent", "--config", str(config))
    assert second.returncode == 0, second.stderr
    other = second.stdout.strip()

    loaded = load_gateway_config(config)  # the TOML still loads
    assert [(k.tenant, k.name) for k in loaded.keys] == [("chat", "ci"), ("agent", None)]
    ring = KeyRing.from_config(loaded)
    assert ring.tenant_for(key) == "chat"
    assert ring.tenant_for(other) == "agent"
    text = config.read_text()
    assert all(line in text for line in comments)

    listed = fairgate("keys", "list", "--config", str(config))
    assert listed.returncode == 0, listed.stderr
    assert key not in listed.stdout and other not in listed.stdout
    lines = listed.stdout.splitlines()
    assert re.match(r"tenant\s+name\s+hash\s+created\s+expires$", lines[0]), listed.stdout
    assert re.match(r"chat\s+ci\s+sha256\$[0-9a-f]{16}\.\.\.\s+20\d\d-\d\d-\d\dT\d\d:\d\d:\d\dZ\s+-$", lines[1])
    assert re.match(r"agent\s+-\s+sha256\$", lines[2]), listed.stdout


def test_keys_add_errors_exit_2_with_one_line(tmp_path: Path) -> None:
    config = tmp_path / "fairgate.toml"
    config.write_text(EXAMPLE.read_text())
    before = config.read_text()

    unknown = fairgate("keys", "add", "nobody", "--config", str(config))
    assert unknown.returncode == 2
    assert unknown.stdout == ""
    assert unknown.stderr.strip().count("\n") == 0 and "nobody" in unknown.stderr
    assert "Traceback" not in unknown.stderr
    assert config.read_text() == before

    config.write_text(before.replace('policy = "gpu_fair"', 'policy = "[bold]x[/bold]"'))
    broken = fairgate("keys", "add", "chat", "--config", str(config))
    assert broken.returncode == 2
    assert "gateway.policy: unknown policy '[bold]x[/bold]'" in broken.stderr  # printed without markup

    missing = fairgate("keys", "list", "--config", str(tmp_path / "absent.toml"))
    assert missing.returncode == 2 and "file not found" in missing.stderr


def test_keys_revoke_and_rotate_errors_exit_2_with_one_line_and_change_nothing(tmp_path: Path) -> None:
    config = tmp_path / "fairgate.toml"
    config.write_text(EXAMPLE.read_text())
    for tenant in ("chat", "agent"):
        assert fairgate("keys", "add", tenant, "--config", str(config), "--name", "ci").returncode == 0
    before = config.read_text()
    for argv, needle in [
        (["revoke"], "--hash PREFIX or --name LABEL"),
        (["revoke", "--hash", "sha256$abc", "--name", "ci"], "--hash PREFIX or --name LABEL"),
        (["revoke", "--hash", "sha256$abc"], "at least 12 characters"),
        (["revoke", "--hash", "sha256$" + "0" * 16], "no [[key]] matches"),
        (["revoke", "--name", "ci"], "2 keys match"),
        (["revoke", "--name", "nobody"], "no [[key]] matches"),
        (["rotate", "--name", "ci"], "2 keys match"),
        (["rotate", "--name", "x", "--grace-hours", "-1"], "--grace-hours"),
    ]:
        done = fairgate("keys", *argv, "--config", str(config))
        assert done.returncode == 2 and needle in done.stderr, (argv, done.stderr)
        assert done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr and done.stdout == ""
        assert config.read_text() == before, argv
    expiring = fairgate("keys", "add", "chat", "--config", str(config), "--expires-in-days", "0")
    assert expiring.returncode == 2 and "--expires-in-days" in expiring.stderr
