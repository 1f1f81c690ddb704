"""Looking up a presented API key costs one hash whatever the number of keys: keys are indexed by their
SHA-256. Salted hashes (``sha256$<salt>$<digest>``) still work, at one hash each per unknown key."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest

from fairgate.gateway import auth
from fairgate.gateway.auth import KeyRing, hash_api_key, is_key_hash, new_api_key, verify_api_key
from tests.conftest import REPO, fairgate

TENANT = "classify"  # a tenant of config/fairgate.example.toml


@pytest.fixture
def sha256_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the SHA-256 computations of ``fairgate.gateway.auth`` (one list entry per call)."""
    calls: list[int] = []

    def counted(data: bytes = b"") -> hashlib._Hash:
        calls.append(1)
        return hashlib.sha256(data)

    monkeypatch.setattr(auth, "hashlib", SimpleNamespace(sha256=counted))
    return calls


def test_the_stored_form_is_the_keys_sha256():
    key = new_api_key()
    stored = hash_api_key(key)
    assert stored == "sha256$" + hashlib.sha256(key.encode()).hexdigest()
    assert is_key_hash(stored) and verify_api_key(key, stored) and not verify_api_key(key + "x", stored)
    salted = hash_api_key(key, bytes(16))
    assert salted == f"sha256${bytes(16).hex()}${hashlib.sha256(bytes(16) + key.encode()).hexdigest()}"
    assert is_key_hash(salted) and verify_api_key(key, salted)


@pytest.mark.parametrize("size", [1, 3000])
def test_an_unknown_key_costs_one_hash_whatever_the_number_of_keys(size, sha256_calls):
    keys = [f"fg-ring-{i:05d}-{'k' * 30}" for i in range(size)]
    ring = KeyRing((f"tenant-{i % 7}", hash_api_key(key)) for i, key in enumerate(keys))
    sha256_calls.clear()
    assert ring.tenant_for(new_api_key()) is None
    assert len(sha256_calls) == 1
    assert ring.tenant_for(keys[-1]) == f"tenant-{(size - 1) % 7}"
    assert len(sha256_calls) == 2


def test_salted_hashes_are_found_and_cost_a_hash_each(sha256_calls):
    indexed, salted = new_api_key(), new_api_key()
    others = [hash_api_key(new_api_key(), bytes([i]) * 16) for i in range(5)]
    ring = KeyRing([("a", hash_api_key(indexed)), ("b", hash_api_key(salted, bytes(16)))] + [("c", h) for h in others])
    assert len(ring) == 7 and ring.salted == 6
    sha256_calls.clear()
    assert ring.tenant_for(new_api_key()) is None
    assert len(sha256_calls) == 1 + 6
    assert ring.tenant_for(indexed) == "a" and ring.tenant_for(salted) == "b"


def test_a_key_stored_for_two_tenants_in_either_form_is_refused():
    key = new_api_key()
    assert KeyRing([("a", hash_api_key(key)), ("b", hash_api_key(key))]).tenant_for(key) is None
    assert KeyRing([("a", hash_api_key(key)), ("b", hash_api_key(key, bytes(8)))]).tenant_for(key) is None
    assert KeyRing([("a", hash_api_key(key)), ("a", hash_api_key(key, bytes(8)))]).tenant_for(key) == "a"


def test_malformed_hashes_are_refused_naming_the_form():
    for stored in ("sha256$" + "0" * 63, "sha256$" + "0" * 65, "sha256$$" + "0" * 64, "sha256$" + "A" * 64):
        assert not is_key_hash(stored)
        with pytest.raises(ValueError, match=r"sha256\$<64 hex digits>"):
            KeyRing([("a", stored)])


def test_keys_add_stores_the_indexed_form(tmp_path):
    config = tmp_path / "fairgate.toml"
    config.write_text((REPO / "config" / "fairgate.example.toml").read_text())
    done = fairgate("keys", "add", TENANT, "--config", str(config))
    assert done.returncode == 0, done.stderr
    key = done.stdout.strip()
    assert f'hash = "sha256${hashlib.sha256(key.encode()).hexdigest()}"' in config.read_text()
