"""Changes to a gateway configuration file: what ``fairgate keys`` and the admin API's write endpoints
(``fairgate.gateway.admin_api``) do.

Each change runs under the file's edit lock (``fairgate.keyfile.locked``: one writer at a time, CLI and
gateway alike), starts from a file that loads, and is checked whole - the file as it will be is validated as
a configuration - before it is written atomically. ``apply``, when given, is called with that configuration
before the file is written and may refuse it by raising: nothing is written then (the admin API applies the
change to the running gateway there, so a change the gateway would refuse never reaches the file).

- Keys (``add_key``, ``revoke_key``, ``rotate_key``): the ``[[key]]`` tables are edited as text, every other
  line kept byte for byte (``fairgate.keyfile``).
- Tenants (``put_tenant``): one ``[quotas.tenants.NAME]`` table set whole with tomlkit (comments and the
  layout of the rest kept), verified to parse to the document expected.

Errors: ``GatewayConfigError`` (the file, or the file as it would be, does not load; its one-line message
names the key), ``ValueError`` (a bad argument, named), ``KeyFileError`` (cannot be edited safely), ``OSError``.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import tomlkit

from fairgate import keyfile
from fairgate.gateway.auth import hash_api_key, new_api_key
from fairgate.gateway.config import GatewayConfig, GatewayConfigError, gateway_config_from_dict, load_gateway_config

T = TypeVar("T")
Apply = Callable[[GatewayConfig], object]
KEY_NAME_MAX = 200
EXPIRES_IN_DAYS_MAX = 36_500
GRACE_HOURS_MAX = 8760.0


@dataclass(frozen=True)
class NewKey:
    """A key just made: ``key`` is shown once (only ``hash`` is stored)."""

    key: str
    hash: str
    tenant: str
    name: str | None
    created: datetime
    expires: datetime | None


@dataclass(frozen=True)
class KeyRef:
    """A stored key, as the file names it: its tenant, label and hash."""

    tenant: str
    name: str | None
    hash: str


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string (quotes, backslashes and control characters escaped)."""
    out = []
    for char in text:
        if char in ('"', "\\"):
            out.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def toml_time(moment: datetime) -> str:
    """A TOML offset date-time in UTC (``2027-01-05T09:30:00Z``)."""
    return moment.astimezone(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def now_s() -> datetime:
    """Now, in UTC, to the second (the precision of ``created`` and ``expires``)."""
    return datetime.now(UTC).replace(microsecond=0)


def edit(path: Path, change: Callable[[str], tuple[str, T]], apply: Apply | None = None) -> T:
    """Under the edit lock: ``change(text)`` gives the new text and a result; the file as it will be is
    validated, given to ``apply``, then written (module docstring). Returns the result."""
    if not path.is_file():
        load_gateway_config(path)  # raises the one-line "file not found" (or "not a file") error
    with keyfile.locked(path):
        load_gateway_config(path)  # the file is valid before it is touched
        text = keyfile.read_text(path)
        updated, result = change(text)
        try:
            data = tomllib.loads(updated)
        except tomllib.TOMLDecodeError as exc:
            raise GatewayConfigError(f"{path}: the edited file does not parse ({exc}); nothing was written") from None
        candidate = gateway_config_from_dict(data, path)
        if apply is not None:
            apply(candidate)
        keyfile.replace_text(path, updated)
        return result


def _key_table(text: str, new: NewKey) -> str:
    """A ``[[key]]`` table for ``new`` to append to ``text`` (its line endings, after a blank line)."""
    nl = keyfile.newline_of(text)
    lines = ["", "[[key]]", f"tenant = {toml_string(new.tenant)}", f"hash = {toml_string(new.hash)}"]
    if new.name is not None:
        lines.append(f"name = {toml_string(new.name)}")
    lines.append(f"created = {toml_time(new.created)}")
    if new.expires is not None:
        lines.append(f"expires = {toml_time(new.expires)}")
    return ("" if text.endswith("\n") or not text else nl) + nl.join(lines) + nl


def _new_key(tenant: str, name: str | None, now: datetime, expires: datetime | None) -> NewKey:
    key = new_api_key()
    return NewKey(key, hash_api_key(key), tenant, name, now, expires)


def add_key(
    path: Path, tenant: str, name: str | None = None, expires_in_days: float | None = None, apply: Apply | None = None
) -> NewKey:
    """Make a key for ``tenant`` (a tenant of the file), append its ``[[key]]`` table, return it (shown once).
    Raises as the module says: a tenant the file lacks, a name over ``KEY_NAME_MAX`` characters, an expiry
    outside (0, ``EXPIRES_IN_DAYS_MAX``] days."""
    if name is not None and len(name) > KEY_NAME_MAX:
        raise ValueError(f"name: at most {KEY_NAME_MAX} characters")
    if expires_in_days is not None and not 0 < expires_in_days <= EXPIRES_IN_DAYS_MAX:
        raise ValueError(f"expires_in_days: a number of days in (0, {EXPIRES_IN_DAYS_MAX}]")

    def change(text: str) -> tuple[str, NewKey]:
        tenants = load_gateway_config(path).quotas.tenants
        if tenant not in tenants:
            raise GatewayConfigError(f"{path}: quotas.tenants: no tenant {tenant!r} (tenants: {', '.join(tenants)})")
        now = now_s()
        expires = None if expires_in_days is None else now + timedelta(days=expires_in_days)
        new = _new_key(tenant, name, now, expires)
        updated = text + _key_table(text, new)
        try:
            tomllib.loads(updated)
        except tomllib.TOMLDecodeError as exc:
            raise GatewayConfigError(
                f"{path}: cannot append a [[key]] table here ({exc}); is `key` defined another way in this file?"
            ) from None
        return updated, new

    return edit(path, change, apply)


def one_key(path: Path, keys: list[dict[str, Any]], hash_prefix: str | None, name: str | None) -> int:
    """The index in ``keys`` (the file's ``[[key]]`` tables) of the one key ``hash_prefix`` or ``name`` names.
    Raises ``ValueError``: neither or both given, a prefix too short, no key or several keys match."""
    if (hash_prefix is None) == (name is None):
        raise ValueError("name the key by its hash prefix or by its label (one of them)")
    if hash_prefix is not None:
        prefix = hash_prefix.removesuffix("...")
        if len(prefix.removeprefix("sha256$")) < 12:
            raise ValueError(f"hash {hash_prefix!r}: give at least 12 characters of the hash after 'sha256$'")
        matches = [i for i, key in enumerate(keys) if str(key.get("hash", "")).startswith(prefix)]
        what = f"hash {hash_prefix!r}"
    else:
        matches = [i for i, key in enumerate(keys) if key.get("name") == name]
        what = f"name {name!r}"
    if not matches:
        raise ValueError(f"{path}: {what}: no [[key]] matches (see: fairgate keys list --config {path})")
    if len(matches) > 1:
        raise ValueError(f"{path}: {what}: {len(matches)} keys match; name one (a longer hash prefix)")
    return matches[0]


def _keys_of(path: Path, text: str) -> list[dict[str, Any]]:
    keys = tomllib.loads(text).get("key", [])
    if not isinstance(keys, list) or not keys:
        raise ValueError(f"{path}: no [[key]] tables")
    return keys


def _without(document: dict[str, Any], index: int, changed: dict[str, Any] | None = None) -> dict[str, Any]:
    """``document`` with its key ``index`` removed (``changed`` None) or replaced by ``changed``."""
    keys = list(document["key"])
    if changed is None:
        del keys[index]
    else:
        keys[index] = changed
    out = {k: v for k, v in document.items() if k != "key"}
    return out | ({"key": keys} if keys else {})


def _ref(key: Mapping[str, Any]) -> KeyRef:
    return KeyRef(str(key.get("tenant")), None if key.get("name") is None else str(key["name"]), str(key["hash"]))


def revoke_key(
    path: Path, hash_prefix: str | None = None, name: str | None = None, apply: Apply | None = None
) -> KeyRef:
    """Remove the one key named by ``hash_prefix`` or ``name`` (``one_key``); returns it. Raises as the module
    says."""

    def change(text: str) -> tuple[str, KeyRef]:
        keys = _keys_of(path, text)
        index = one_key(path, keys, hash_prefix, name)
        updated = keyfile.edited(
            path, text, lambda lines, spans: keyfile.remove_key(lines, spans[index]), lambda d: _without(d, index)
        )
        return updated, _ref(keys[index])

    return edit(path, change, apply)


def rotate_key(
    path: Path,
    hash_prefix: str | None = None,
    name: str | None = None,
    grace_hours: float = 24.0,
    apply: Apply | None = None,
) -> tuple[NewKey, KeyRef, datetime | None]:
    """A new key for the tenant and label of the one named (``one_key``); the old one expires after
    ``grace_hours`` (sooner if it was to; 0: removed now). Returns the new key, the old one and when it
    stops working (None: now). Raises as the module says; ``ValueError`` for hours outside [0, 8760]."""
    if not 0 <= grace_hours <= GRACE_HOURS_MAX:
        raise ValueError(f"grace_hours: a number of hours in [0, {GRACE_HOURS_MAX:g}]")

    def change(text: str) -> tuple[str, tuple[NewKey, KeyRef, datetime | None]]:
        keys = _keys_of(path, text)
        index = one_key(path, keys, hash_prefix, name)
        old, now = keys[index], now_s()
        ends = now + timedelta(hours=grace_hours)
        if old.get("expires") is not None:
            ends = min(ends, old["expires"])
        nl = keyfile.newline_of(text)

        def edit_lines(lines: list[str], spans: list[keyfile.Span]) -> list[str]:
            if grace_hours == 0:
                return keyfile.remove_key(lines, spans[index])
            return keyfile.set_expiry(lines, spans[index], toml_time(ends), nl)

        kept = None if grace_hours == 0 else old | {"expires": ends}
        updated = keyfile.edited(path, text, edit_lines, lambda d: _without(d, index, kept))
        new = _new_key(str(old["tenant"]), old.get("name"), now, None)
        return updated + _key_table(updated, new), (new, _ref(old), None if grace_hours == 0 else ends)

    return edit(path, change, apply)


def put_tenant(
    path: Path, tenant: str, table: Mapping[str, Any], apply: Apply | None = None
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Set ``[quotas.tenants.<tenant>]`` to ``table`` (its whole table: tier, weight, priority, limits,
    model_class; what it omits takes the defaults). Returns the table before (None: a new tenant) and after.
    Raises as the module says (the file as it would be names the key at fault)."""

    def change(text: str) -> tuple[str, tuple[dict[str, Any] | None, dict[str, Any]]]:
        document = tomlkit.parse(text)
        expected = tomllib.loads(text)
        quotas = document.get("quotas")
        if quotas is None or not isinstance(quotas, dict):
            raise GatewayConfigError(f"{path}: quotas: no [quotas] table to add a tenant to")
        tenants = quotas.get("tenants")
        if tenants is None:
            tenants = quotas["tenants"] = tomlkit.table(is_super_table=True)
        before = expected["quotas"].get("tenants", {}).get(tenant)
        tenants[tenant] = tomlkit.item(dict(table))
        expected["quotas"].setdefault("tenants", {})[tenant] = dict(table)
        updated = tomlkit.dumps(document)
        if tomllib.loads(updated) != expected:
            raise keyfile.KeyFileError(f"{path}: quotas.tenants.{tenant}: the table cannot be set here safely")
        return updated, (before, dict(table))

    return edit(path, change, apply)


__all__ = [
    "KeyRef",
    "NewKey",
    "add_key",
    "edit",
    "now_s",
    "one_key",
    "put_tenant",
    "revoke_key",
    "rotate_key",
    "toml_string",
    "toml_time",
]
