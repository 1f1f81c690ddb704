"""Changes to a gateway configuration file: what ``fairgate keys`` and the admin API's write endpoints
(``fairgate.gateway.admin_api``) do.

Each change runs under the file's edit lock (``fairgate.keyfile.locked``: one writer at a time, CLI and
gateway alike), starts from a file that loads, and is checked whole - the file as it will be is validated as
a configuration - before it is written atomically. ``apply``, when given, is called with that configuration
before the file is written and may refuse it by raising: nothing is written then (the admin API applies the
change to the running gateway there, so a change the gateway would refuse never reaches the file).

- Keys (``add_key``, ``revoke_key``, ``rotate_key``): the ``[[key]]`` tables are edited as text, every other
  line kept byte for byte (``fairgate.keyfile``).
- Admin keys (``revoke_admin_key``): one hash taken out of ``[admin].key_hashes`` with tomlkit, verified to
  parse to the document expected.
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
EXPIRES_IN_DAYS_MIN = 1 / 1440  # a minute: a key that expires as it is made is a mistake
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


Change = Callable[[str], tuple[str, T]]
Rotated = tuple["NewKey", "KeyRef", datetime | None]
Tables = tuple[dict[str, Any] | None, dict[str, Any]]


@dataclass(frozen=True)
class StagedEdit:
    """A change made and checked (``stage``): the configuration as it will be, the change's result, and the
    new text written beside the file, to ``commit`` or ``discard``."""

    candidate: GatewayConfig
    result: Any
    file: keyfile.Staged


def stage(path: Path, change: Change[Any]) -> StagedEdit:
    """``change(text)`` on the file's text, the result validated whole and written beside the file (the caller
    holds the edit lock: ``keyfile.lock``). Raises as the module says; nothing is written then."""
    load_gateway_config(path)  # the file is valid before it is touched (and exists)
    text = keyfile.read_text(path)
    updated, result = change(text)
    try:
        data = tomllib.loads(updated)
    except tomllib.TOMLDecodeError as exc:
        raise GatewayConfigError(f"{path}: the edited file does not parse ({exc}); nothing was written") from None
    candidate = gateway_config_from_dict(data, path)
    return StagedEdit(candidate, result, keyfile.stage(path, updated))


def edit(path: Path, change: Change[T], apply: Apply | None = None) -> T:
    """Under the edit lock: ``stage`` the change, give the configuration as it will be to ``apply`` (which may
    refuse it by raising), then put the file in place (module docstring). Returns the change's result."""
    if not path.is_file():
        load_gateway_config(path)  # raises the one-line "file not found" (or "not a file") error
    with keyfile.locked(path):
        staged = stage(path, change)
        try:
            if apply is not None:
                apply(staged.candidate)
        except BaseException:
            staged.file.discard()
            raise
        staged.file.commit()
        result: T = staged.result
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


def key_added(path: Path, tenant: str, name: str | None, expires_in_days: float | None) -> Change[NewKey]:
    """Make a key for ``tenant`` (a tenant of the file) and append its ``[[key]]`` table: the change; its
    result is the key (shown once). Raises ``ValueError`` now: a name over ``KEY_NAME_MAX`` characters, an
    expiry outside [``EXPIRES_IN_DAYS_MIN``, ``EXPIRES_IN_DAYS_MAX``] days; the change raises
    ``GatewayConfigError`` for a tenant the file lacks."""
    if name is not None and len(name) > KEY_NAME_MAX:
        raise ValueError(f"name: at most {KEY_NAME_MAX} characters")
    if expires_in_days is not None and not EXPIRES_IN_DAYS_MIN <= expires_in_days <= EXPIRES_IN_DAYS_MAX:
        raise ValueError(f"expires_in_days: a number of days in [{EXPIRES_IN_DAYS_MIN:.6g}, {EXPIRES_IN_DAYS_MAX}]")

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

    return change


def add_key(
    path: Path, tenant: str, name: str | None = None, expires_in_days: float | None = None, apply: Apply | None = None
) -> NewKey:
    """``key_added``, made (``edit``)."""
    return edit(path, key_added(path, tenant, name, expires_in_days), apply)


def key_revoked(path: Path, hash_prefix: str | None, name: str | None) -> Change[KeyRef]:
    """Remove the one key named by ``hash_prefix`` or ``name`` (``one_key``): the change; its result is the
    key removed."""

    def change(text: str) -> tuple[str, KeyRef]:
        keys = _keys_of(path, text)
        index = one_key(path, keys, hash_prefix, name)
        updated = keyfile.edited(
            path, text, lambda lines, spans: keyfile.remove_key(lines, spans[index]), lambda d: _without(d, index)
        )
        return updated, _ref(keys[index])

    return change


def revoke_key(
    path: Path, hash_prefix: str | None = None, name: str | None = None, apply: Apply | None = None
) -> KeyRef:
    """``key_revoked``, made (``edit``)."""
    return edit(path, key_revoked(path, hash_prefix, name), apply)


def admin_key_revoked(path: Path, hash_prefix: str) -> Change[str]:
    """Remove the one ``[admin].key_hashes`` entry that starts with ``hash_prefix`` (12+ characters after
    ``sha256$``, as ``fairgate keys list`` shows it): the change; its result is the hash removed. Raises
    ``ValueError``: a prefix too short, no hash or several match, or it is the last one (the admin API would
    be locked); ``KeyFileError``: the list cannot be edited
    safely (it is not an array of strings in an ``[admin]`` table)."""
    prefix = hash_prefix.removesuffix("...")
    if len(prefix.removeprefix("sha256$")) < 12:
        raise ValueError(f"hash {hash_prefix!r}: give at least 12 characters of the hash after 'sha256$'")

    def change(text: str) -> tuple[str, str]:
        document = tomlkit.parse(text)  # comments and layout kept
        expected = tomllib.loads(text)
        hashes = expected.get("admin", {}).get("key_hashes", [])
        matches = [i for i, h in enumerate(hashes) if str(h).startswith(prefix)]
        if not matches:
            raise ValueError(f"{path}: hash {hash_prefix!r}: no admin key hash matches (see: fairgate keys list)")
        if len(matches) > 1:
            raise ValueError(f"{path}: hash {hash_prefix!r}: {len(matches)} admin hashes match; give a longer prefix")
        if len(hashes) == 1:  # nobody could reach the admin API (writes, reloads, metrics) any more
            raise ValueError(
                f"{path}: hash {hash_prefix!r} is the last admin key; add another first (fairgate keys add-admin)"
            )
        gone = str(hashes[matches[0]])
        listed = document.get("admin", {}).get("key_hashes")
        if not isinstance(listed, tomlkit.items.Array):
            raise keyfile.KeyFileError(f"{path}: admin.key_hashes: not an array here; edit it by hand")
        del listed[matches[0]]
        del expected["admin"]["key_hashes"][matches[0]]
        updated = tomlkit.dumps(document)
        if tomllib.loads(updated) != expected:
            raise keyfile.KeyFileError(f"{path}: admin.key_hashes: the hash cannot be removed here safely")
        return updated, gone

    return change


def revoke_admin_key(path: Path, hash_prefix: str, apply: Apply | None = None) -> str:
    """``admin_key_revoked``, made (``edit``)."""
    return edit(path, admin_key_revoked(path, hash_prefix), apply)


def key_rotated(path: Path, hash_prefix: str | None, name: str | None, grace_hours: float) -> Change[Rotated]:
    """A new key for the tenant and label of the one named (``one_key``); the old one expires after
    ``grace_hours`` (sooner if it was to; 0: removed now): the change; its result is the new key, the old
    one and when it stops working (None: now). Raises ``ValueError`` now for hours outside [0, 8760]."""
    if not 0 <= grace_hours <= GRACE_HOURS_MAX:
        raise ValueError(f"grace_hours: a number of hours in [0, {GRACE_HOURS_MAX:g}]")

    def change(text: str) -> tuple[str, Rotated]:
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

    return change


def rotate_key(
    path: Path,
    hash_prefix: str | None = None,
    name: str | None = None,
    grace_hours: float = 24.0,
    apply: Apply | None = None,
) -> Rotated:
    """``key_rotated``, made (``edit``)."""
    return edit(path, key_rotated(path, hash_prefix, name, grace_hours), apply)


def tenant_put(path: Path, tenant: str, table: Mapping[str, Any]) -> Change[Tables]:
    """Set ``[quotas.tenants.<tenant>]`` to ``table`` (its whole table: tier, weight, priority, limits,
    model_class; what it omits takes the defaults): the change; its result is the table before (None: a new
    tenant) and after. An existing table is changed where it stands (the comments around it kept); the
    file's line endings are kept."""

    def change(text: str) -> tuple[str, Tables]:
        document = tomlkit.parse(text)
        expected = tomllib.loads(text)
        quotas = document.get("quotas")
        if quotas is None or not isinstance(quotas, dict):
            raise GatewayConfigError(f"{path}: quotas: no [quotas] table to add a tenant to")
        tenants = quotas.get("tenants")
        if tenants is None:
            tenants = quotas["tenants"] = tomlkit.table(is_super_table=True)
        before = expected["quotas"].get("tenants", {}).get(tenant)
        current = tenants.get(tenant)
        if isinstance(current, dict) and not isinstance(current, tomlkit.items.InlineTable):
            for key in [k for k in current if k not in table]:
                del current[key]
            for key, value in table.items():
                if key not in current or current[key].unwrap() != value:  # what stays the same is not touched
                    current[key] = _inline(value)
        else:
            added = tomlkit.table()
            for key, value in table.items():
                added[key] = _inline(value)
            tenants[tenant] = added
        expected["quotas"].setdefault("tenants", {})[tenant] = dict(table)
        updated = tomlkit.dumps(document)
        if keyfile.newline_of(text) == "\r\n":
            updated = updated.replace("\r\n", "\n").replace("\n", "\r\n")
        if tomllib.loads(updated) != expected:
            raise keyfile.KeyFileError(f"{path}: quotas.tenants.{tenant}: the table cannot be set here safely")
        return updated, (before, dict(table))

    return change


def _inline(value: Any) -> Any:
    """``value`` for a tenant's table, a table in it as an inline table: it stays on its key's line, not
    after whatever comments follow the tenant's table."""
    if isinstance(value, Mapping):
        table = tomlkit.inline_table()
        for key, inner in value.items():
            table[key] = _inline(inner)
        return table
    return value


def put_tenant(path: Path, tenant: str, table: Mapping[str, Any], apply: Apply | None = None) -> Tables:
    """``tenant_put``, made (``edit``)."""
    return edit(path, tenant_put(path, tenant, table), apply)


__all__ = [
    "KeyRef",
    "NewKey",
    "StagedEdit",
    "add_key",
    "admin_key_revoked",
    "edit",
    "key_added",
    "key_revoked",
    "key_rotated",
    "now_s",
    "one_key",
    "put_tenant",
    "revoke_admin_key",
    "revoke_key",
    "rotate_key",
    "stage",
    "tenant_put",
    "toml_string",
    "toml_time",
]
