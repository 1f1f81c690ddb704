"""API keys and on-behalf-of tokens: who is calling, and for which tenant (seed 003, "identity").

The tenant of a request always comes from its credential, never from its body or headers.

API keys are ``fg-`` followed by 43 URL-safe characters (32 random bytes). Only a hash is stored, as
``sha256$<digest hex>``, the key's SHA-256 (64 hex digits, lower case). A salt protects guessable secrets
such as passwords; a key of 32 random bytes cannot be guessed, and without a salt the hash of a presented
key is its index: ``KeyRing`` maps it to its tenant in one hash and one dictionary probe, however many keys
there are. Salted hashes, ``sha256$<salt hex>$<digest hex>`` with the digest ``sha256(salt || key)``, are
accepted too, but each costs one hash per lookup of a key not found otherwise.

An internal service (a *delegate*, itself a tenant) acting for another tenant presents an on-behalf-of
token: ``<payload>.<signature>``, both base64url without padding, where the payload is the compact
JSON ``{"d":delegate,"exp":expires_at_s,"t":tenant,"v":1}`` and the signature is HMAC-SHA256 of the
payload's base64url text under a secret shared by the gateway and its delegates. A payload with a key given
twice is malformed (which value would count?), and a token that expires further ahead than the verifier's
``lifetime_max_s`` (the gateway's ``[gateway].delegation_token_lifetime_max_s``, default 24 h) is refused: a
leaked token must not stay good for long.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import re
import secrets
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fairgate.gateway.config import GatewayConfig

KEY_PREFIX = "fg-"
KEY_HASH_PATTERN = re.compile(r"sha256\$(?:((?:[0-9a-f]{2}){8,64})\$)?([0-9a-f]{64})")
"""A stored key hash: ``sha256$``, optionally a salt (8 to 64 bytes, lower-case hex) and ``$``, then 64 hex
digits (group 1: the salt or None; group 2: the digest)."""
KEY_HASH_FORMS = "sha256$<64 hex digits> (or sha256$<salt hex>$<64 hex digits>)"
KEY_LENGTH_MAX = 512  # a longer presented key is rejected without hashing
DELEGATION_SECRET_BYTES_MIN = 16
TOKEN_LENGTH_MAX = 4096  # a longer on-behalf-of token is malformed
TOKEN_LIFETIME_MAX_S = 86_400.0  # the default bound on how far ahead a presented token may expire
_TOKEN_VERSION = 1


def new_api_key() -> str:
    """A fresh random API key: ``fg-`` + 32 random bytes as URL-safe base64 (43 characters)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def is_key_hash(text: object) -> bool:
    """Whether ``text`` is a well-formed stored key hash (see ``KEY_HASH_PATTERN``)."""
    return isinstance(text, str) and KEY_HASH_PATTERN.fullmatch(text) is not None


def _digest(salt: bytes, key: str) -> str:
    return hashlib.sha256(salt + key.encode("utf-8")).hexdigest()


def _fingerprint(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def hash_api_key(key: str, salt: bytes | None = None) -> str:
    """The stored form of ``key``: ``sha256$<hex of sha256(utf-8 key)>`` (see the module docstring), or
    with ``salt`` ``sha256$<salt hex>$<hex of sha256(salt || utf-8 key)>``.

    Args:
        salt: None, or 8 to 64 bytes (a salted hash: found by a scan, not the index).

    Raises:
        ValueError: an empty key or a salt of the wrong length.
    """
    if not key:
        raise ValueError("an API key cannot be empty")
    if salt is None:
        return f"sha256${_fingerprint(key).hex()}"
    if not 8 <= len(salt) <= 64:
        raise ValueError(f"the salt must be 8 to 64 bytes, not {len(salt)}")
    return f"sha256${salt.hex()}${_digest(salt, key)}"


def verify_api_key(key: str, stored: str) -> bool:
    """Whether ``key`` is the key ``stored`` (a ``hash_api_key`` result) was made from; constant time.

    Raises:
        ValueError: ``stored`` is not a ``KEY_HASH_PATTERN``.
    """
    match = KEY_HASH_PATTERN.fullmatch(stored) if isinstance(stored, str) else None
    if match is None:
        raise ValueError(f"a stored key hash must look like {KEY_HASH_FORMS}")
    if not isinstance(key, str) or not key or len(key) > KEY_LENGTH_MAX:
        return False
    salt, digest = match.groups()
    computed = _fingerprint(key).hex() if salt is None else _digest(bytes.fromhex(salt), key)
    return hmac.compare_digest(computed, digest)


class KeyRing:
    """The tenants' API keys, by hash: ``tenant_for(key)`` says whose key it is.

    Keys stored as their SHA-256 are indexed by it: a lookup is one hash and one dictionary probe (of a
    digest the caller cannot choose, so its timing tells nothing about the stored keys). Salted hashes
    each have their own salt, so a key is checked against every one of them (``salted`` of them); a key
    found that way is remembered by its SHA-256. Unknown keys are never remembered.
    """

    CACHE_ENTRIES_MAX = 100_000

    def __init__(self, entries: Iterable[tuple[str, str]]) -> None:
        """``entries``: ``(tenant, stored hash)`` pairs.

        Raises:
            ValueError: a malformed stored hash (the message names its position).
        """
        self._indexed: dict[bytes, set[str]] = {}  # SHA-256 of a key -> its tenants (two: refused)
        self._salted: list[tuple[str, bytes, str]] = []  # (tenant, salt, hex digest)
        for index, (tenant, stored) in enumerate(entries):
            match = KEY_HASH_PATTERN.fullmatch(stored) if isinstance(stored, str) else None
            if match is None:
                raise ValueError(f"key hash #{index} (tenant {tenant!r}) must look like {KEY_HASH_FORMS}")
            salt, digest = match.groups()
            if salt is None:
                self._indexed.setdefault(bytes.fromhex(digest), set()).add(tenant)
            else:
                self._salted.append((tenant, bytes.fromhex(salt), digest))
        self._size = sum(len(tenants) for tenants in self._indexed.values()) + len(self._salted)
        self._found: dict[bytes, str] = {}  # SHA-256 of a key -> the tenant of its salted hash

    @classmethod
    def from_config(cls, config: GatewayConfig) -> KeyRing:
        """The ring of the ``[[key]]`` tables of a loaded gateway configuration."""
        return cls((key.tenant, key.hash) for key in config.keys)

    def __len__(self) -> int:
        return self._size

    @property
    def salted(self) -> int:
        """How many stored hashes are salted (each checked on every lookup of an unknown key)."""
        return len(self._salted)

    def tenant_for(self, key: str) -> str | None:
        """The tenant whose key ``key`` is, or ``None`` for an unknown, empty or over-long key.

        A key that matches the hashes of two different tenants (an operator's mistake) is refused: ``None``.
        """
        owners = self.owners_for(key)
        return owners.pop() if len(owners) == 1 else None

    def owners_for(self, key: str) -> set[str]:
        """Every owner (tenant) a stored hash of ``key`` is filed under; empty for an unknown, empty or
        over-long key. ``tenant_for`` accepts exactly one."""
        if not isinstance(key, str) or not key or len(key) > KEY_LENGTH_MAX:
            return set()
        fingerprint = _fingerprint(key)
        tenants = set(self._indexed.get(fingerprint, ()))
        if self._salted:
            tenants |= self._salted_tenants(key, fingerprint)
        return tenants

    def _salted_tenants(self, key: str, fingerprint: bytes) -> set[str]:
        known = self._found.get(fingerprint)
        if known is not None:
            return {known}
        tenants = {tenant for tenant, salt, digest in self._salted if hmac.compare_digest(_digest(salt, key), digest)}
        if len(tenants) == 1:
            if len(self._found) >= self.CACHE_ENTRIES_MAX:
                self._found.clear()
            self._found[fingerprint] = next(iter(tenants))
        return tenants


class DelegationError(ValueError):
    """An on-behalf-of token was refused. ``reason``: ``malformed``, ``bad_signature``, ``wrong_delegate``,
    ``expired`` or ``lifetime_too_long``; ``str()`` is one line saying why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64decode(text: str) -> bytes:
    if not re.fullmatch(r"[A-Za-z0-9_-]*", text) or len(text) % 4 == 1:
        raise ValueError("not base64url")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _check_secret(secret: bytes) -> None:
    if not isinstance(secret, bytes) or len(secret) < DELEGATION_SECRET_BYTES_MIN:
        raise ValueError(f"the delegation secret must be at least {DELEGATION_SECRET_BYTES_MIN} bytes")


def _sign(secret: bytes, payload: str) -> bytes:
    return hmac.new(secret, payload.encode("ascii"), hashlib.sha256).digest()


def make_on_behalf_of(secret: bytes, delegate: str, tenant: str, expires_at_s: float) -> str:
    """A token letting ``delegate`` act for ``tenant`` until ``expires_at_s`` (seconds since the epoch).

    Format: ``base64url(payload) + "." + base64url(HMAC-SHA256(secret, base64url(payload)))``, no
    padding, payload ``{"d":delegate,"exp":expires_at_s,"t":tenant,"v":1}`` (compact, sorted keys).

    Raises:
        ValueError: a secret shorter than 16 bytes, an empty name or a non-finite expiry.
    """
    _check_secret(secret)
    if not delegate or not tenant:
        raise ValueError("delegate and tenant must be non-empty")
    if not math.isfinite(expires_at_s):
        raise ValueError("expires_at_s must be a finite number of seconds since the epoch")
    document = {"d": delegate, "exp": expires_at_s, "t": tenant, "v": _TOKEN_VERSION}
    payload = _b64encode(json.dumps(document, separators=(",", ":"), sort_keys=True).encode("utf-8"))
    return f"{payload}.{_b64encode(_sign(secret, payload))}"


def verify_on_behalf_of(
    secret: bytes, token: str, delegate: str, now_s: float, lifetime_max_s: float = TOKEN_LIFETIME_MAX_S
) -> str:
    """The tenant ``token`` lets ``delegate`` (the authenticated caller) act for, at time ``now_s``.

    Checks, in order: the shape, the signature (constant time), the payload (each key once), the
    delegate, the expiry (a token is expired from ``exp`` on), the lifetime (``exp`` at most
    ``lifetime_max_s`` after ``now_s``).

    Raises:
        DelegationError: ``reason`` ``malformed``, ``bad_signature``, ``wrong_delegate``, ``expired`` or
            ``lifetime_too_long``.
        ValueError: a secret shorter than 16 bytes (a configuration error, not the caller's).
    """
    _check_secret(secret)
    if not isinstance(token, str) or len(token) > TOKEN_LENGTH_MAX or token.count(".") != 1:
        raise DelegationError("malformed", "on-behalf-of token is malformed: expected <payload>.<signature>")
    payload, signature_text = token.split(".")
    try:
        signature = _b64decode(signature_text)
        raw = _b64decode(payload)
    except (ValueError, binascii.Error):
        raise DelegationError("malformed", "on-behalf-of token is malformed: not base64url") from None
    if not hmac.compare_digest(signature, _sign(secret, payload)):
        raise DelegationError("bad_signature", "on-behalf-of token has a bad signature")
    document = _parse_payload(raw)
    if not hmac.compare_digest(document["d"].encode("utf-8"), delegate.encode("utf-8")):
        raise DelegationError(
            "wrong_delegate", f"on-behalf-of token was issued to {document['d']!r}, not to {delegate!r}"
        )
    if now_s >= document["exp"]:
        raise DelegationError("expired", f"on-behalf-of token expired {now_s - document['exp']:.0f} s ago")
    if document["exp"] - now_s > lifetime_max_s:
        raise DelegationError(
            "lifetime_too_long",
            f"on-behalf-of token expires in {document['exp'] - now_s:,.0f} s; "
            f"this gateway accepts at most {lifetime_max_s:,.0f} s",
        )
    tenant: str = document["t"]
    return tenant


class _KeyTwice(ValueError):
    pass


def _each_key_once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise _KeyTwice(key)
        document[key] = value
    return document


def _parse_payload(raw: bytes) -> dict[str, Any]:
    try:
        document = json.loads(raw.decode("utf-8"), object_pairs_hook=_each_key_once)
    except _KeyTwice as twice:
        key = str(twice)[:40]
        message = f"on-behalf-of token is malformed: key {key!r} given twice in its payload"
        raise DelegationError("malformed", message) from None
    except (UnicodeDecodeError, ValueError):
        document = None
    valid = (
        isinstance(document, dict)
        and set(document) == {"d", "exp", "t", "v"}
        and type(document["v"]) is int
        and document["v"] == _TOKEN_VERSION
        and isinstance(document["d"], str)
        and document["d"]
        and isinstance(document["t"], str)
        and document["t"]
        and isinstance(document["exp"], (int, float))
        and not isinstance(document["exp"], bool)
        and math.isfinite(document["exp"])
    )
    if not valid:
        raise DelegationError("malformed", "on-behalf-of token is malformed: bad payload")
    assert isinstance(document, dict)
    return document


__all__ = [
    "KEY_HASH_PATTERN",
    "DelegationError",
    "KeyRing",
    "hash_api_key",
    "is_key_hash",
    "make_on_behalf_of",
    "new_api_key",
    "verify_api_key",
    "verify_on_behalf_of",
]
