"""``fairgate keys ...``: make, list, revoke and rotate the gateway's API keys (only their hashes are stored).

``fairgate keys add TENANT --config fairgate.toml [--name LABEL] [--expires-in-days D]`` appends a ``[[key]]``
table to the configuration (its comments and layout stay as they are), stamped with its ``created`` time
(and ``expires``), and prints the new key once on stdout. ``fairgate keys list --config fairgate.toml``
prints tenants, labels, hash prefixes, created and expiry times, never keys. ``fairgate keys revoke`` removes
one key, named by a prefix of its hash (as ``list`` shows it) or by its label; ``fairgate keys rotate`` makes
a new key for the same tenant and label and lets the old one work ``--grace-hours`` more (0: revoked now).
The gateway applies the file on ``SIGHUP`` or ``POST /admin/reload`` (``fairgate.gateway.reload``).
Every user error prints one line on stderr and exits with code 2.
"""

from __future__ import annotations

import sys
import tomllib
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from fairgate import keyfile

keys_app = typer.Typer(no_args_is_help=True, help="Make and list the gateway's API keys (stored hashed).")
errors = Console(stderr=True)
T = TypeVar("T")

ConfigPath = Annotated[Path, typer.Option("--config", help="Gateway configuration TOML.")]


def _say(message: str) -> None:
    errors.print(message, markup=False, emoji=False, highlight=False, soft_wrap=True)


def _guard(action: Callable[[], T]) -> T:
    """Run ``action``; a configuration or file error -> one line on stderr, exit code 2."""
    from fairgate.gateway.config import GatewayConfigError

    try:
        return action()
    except (GatewayConfigError, OSError, ValueError, tomllib.TOMLDecodeError) as exc:
        _say(f"error: {exc}")
        raise typer.Exit(2) from None


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


APPLY = "Send the gateway SIGHUP (kill -HUP <pid>) or POST /admin/reload to apply it."


def _now() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


def _toml_time(moment: datetime) -> str:
    """A TOML offset date-time in UTC (``2027-01-05T09:30:00Z``)."""
    return moment.astimezone(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _shown(moment: datetime | None) -> str:
    return "-" if moment is None else _toml_time(moment)


def _expiry(moment: datetime | None, now: datetime) -> str:
    return _shown(moment) + (" (expired)" if moment is not None and moment <= now else "")


def _under_lock(config: Path, run: Callable[[], T]) -> T:
    """``run()`` holding the configuration's edit lock (``keyfile.locked``); a missing file is the usual error."""
    if not config.is_file():
        from fairgate.gateway.config import load_gateway_config

        load_gateway_config(config)  # raises the one-line "file not found" (or "not a file") error
    with keyfile.locked(config):
        return run()


def _key_table(
    text: str, tenant: str, hash_: str, name: str | None, created: datetime, expires: datetime | None
) -> str:
    """A ``[[key]]`` table to append to ``text`` (its line endings, after a blank line)."""
    nl = keyfile.newline_of(text)
    lines = ["", "[[key]]", f"tenant = {toml_string(tenant)}", f"hash = {toml_string(hash_)}"]
    if name is not None:
        lines.append(f"name = {toml_string(name)}")
    lines.append(f"created = {_toml_time(created)}")
    if expires is not None:
        lines.append(f"expires = {_toml_time(expires)}")
    return ("" if text.endswith("\n") or not text else nl) + nl.join(lines) + nl


def _printable(text: str) -> str:
    """``text`` with control and other unprintable characters escaped (a label may hold any)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


@keys_app.command()
def add(
    tenant: Annotated[str, typer.Argument(help="A tenant of the quotas.tenants table.")],
    config: ConfigPath,
    name: Annotated[str | None, typer.Option("--name", help="A label for the key (e.g. where it is used).")] = None,
    expires_in_days: Annotated[
        float | None, typer.Option("--expires-in-days", help="The key stops working this many days from now.")
    ] = None,
) -> None:
    """Make an API key for TENANT, store its hash in the configuration and print the key (once)."""
    from fairgate.gateway.auth import hash_api_key, new_api_key
    from fairgate.gateway.config import GatewayConfigError, gateway_config_from_dict, load_gateway_config

    def run() -> str:
        loaded = load_gateway_config(config)
        if tenant not in loaded.quotas.tenants:
            raise GatewayConfigError(
                f"{config}: quotas.tenants: no tenant {tenant!r} "
                f"(tenants: {', '.join(loaded.quotas.tenants) or 'none'})"
            )
        if name is not None and len(name) > 200:
            raise ValueError("--name: at most 200 characters")
        if expires_in_days is not None and not 0 < expires_in_days <= 36_500:
            raise ValueError("--expires-in-days: a number of days in (0, 36500]")
        key = new_api_key()
        text = keyfile.read_text(config)
        now = _now()
        expires = None if expires_in_days is None else now + timedelta(days=expires_in_days)
        updated = text + _key_table(text, tenant, hash_api_key(key), name, now, expires)
        try:
            data = tomllib.loads(updated)
        except tomllib.TOMLDecodeError as exc:
            raise GatewayConfigError(
                f"{config}: cannot append a [[key]] table here ({exc}); is `key` defined another way in this file?"
            ) from None
        gateway_config_from_dict(data, config)  # the file as it will be, before writing it
        keyfile.replace_text(config, updated)
        return key

    key = _guard(lambda: _under_lock(config, run))
    sys.stdout.write(key + "\n")
    sys.stdout.flush()
    label = f" ({name})" if name else ""
    _say(
        f"added a key for tenant {tenant!r}{label} to {config}; it is printed above and cannot be shown again "
        f"(only its hash is stored). {APPLY}"
    )


@keys_app.command("list")
def list_keys(config: ConfigPath) -> None:
    """Print the tenant, label and hash prefix of every key and admin credential (never a key)."""
    from fairgate.gateway.config import load_gateway_config

    loaded = _guard(lambda: load_gateway_config(config))
    now = _now()
    rows = [
        (
            _printable(k.tenant),
            _printable(k.name or "-"),
            k.hash[:23] + "...",
            _shown(k.created),
            _expiry(k.expires, now),
        )
        for k in loaded.keys
    ]
    rows += [("(admin)", "-", h[:23] + "...", "-", "-") for h in loaded.admin.key_hashes]
    if not rows:
        _say(f"no keys in {config}; make one with: fairgate keys add TENANT --config {config}")
        return
    header = ("tenant", "name", "hash", "created", "expires")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        sys.stdout.write("  ".join(f"{cell:<{width}}" for cell, width in zip(row, widths, strict=True)).rstrip() + "\n")


@keys_app.command("add-admin")
def add_admin(config: ConfigPath) -> None:
    """Make an admin key (``/metrics``, ``/admin/...``, the dashboard's all-tenant view), store its hash in
    ``\\[admin].key_hashes`` and print the key (once)."""
    import tomlkit

    from fairgate.gateway.auth import hash_api_key, new_api_key
    from fairgate.gateway.config import GatewayConfigError, gateway_config_from_dict, load_gateway_config

    def run() -> str:
        load_gateway_config(config)  # the file is valid before it is touched
        key = new_api_key()
        document = tomlkit.parse(keyfile.read_text(config))  # comments and layout kept
        admin = document.get("admin")
        if admin is None:
            admin = tomlkit.table()
            document["admin"] = admin
        hashes = admin.get("key_hashes")
        if hashes is None:
            admin["key_hashes"] = [hash_api_key(key)]
        elif isinstance(hashes, list):
            hashes.append(hash_api_key(key))
        else:
            raise GatewayConfigError(f"{config}: admin.key_hashes must be a list of hashes")
        updated = tomlkit.dumps(document)
        gateway_config_from_dict(tomllib.loads(updated), config)  # the file as it will be, before writing it
        keyfile.replace_text(config, updated)
        return key

    key = _guard(lambda: _under_lock(config, run))
    sys.stdout.write(key + "\n")
    sys.stdout.flush()
    _say(
        f"added an admin key to {config}; it is printed above and cannot be shown again (only its hash is "
        f"stored). {APPLY}"
    )


HashOption = Annotated[
    str | None, typer.Option("--hash", help="The key's hash, or its first 12+ characters (as `keys list` shows).")
]
NameOption = Annotated[str | None, typer.Option("--name", help="The key's label (it must name one key).")]


def _one_key(config: Path, keys: Any, hash_prefix: str | None, name: str | None) -> int:
    """The index in ``keys`` (the document's ``[[key]]`` tables) of the one key ``--hash`` or ``--name`` names.
    Raises ``ValueError``: neither or both given, a prefix too short, no key or several keys match."""
    if (hash_prefix is None) == (name is None):
        raise ValueError("name the key with --hash PREFIX or --name LABEL (one of them)")
    if hash_prefix is not None:
        prefix = hash_prefix.removesuffix("...")
        if len(prefix.removeprefix("sha256$")) < 12:
            raise ValueError(f"--hash {hash_prefix!r}: give at least 12 characters of the hash after 'sha256$'")
        matches = [i for i, key in enumerate(keys) if str(key.get("hash", "")).startswith(prefix)]
        what = f"--hash {hash_prefix!r}"
    else:
        matches = [i for i, key in enumerate(keys) if key.get("name") == name]
        what = f"--name {name!r}"
    if not matches:
        raise ValueError(f"{config}: {what}: no [[key]] matches (see: fairgate keys list --config {config})")
    if len(matches) > 1:
        raise ValueError(f"{config}: {what}: {len(matches)} keys match; name one (a longer --hash)")
    return matches[0]


def _edit_keys(config: Path, change: Callable[[str, list[dict[str, Any]]], tuple[str, T]]) -> T:
    """Under the edit lock: ``change(text, the parsed [[key]] tables)`` gives the new text (verified by
    ``keyfile.edited``) and a result; the file as it will be is checked whole, then written atomically."""
    from fairgate.gateway.config import gateway_config_from_dict, load_gateway_config

    def run() -> T:
        load_gateway_config(config)  # the file is valid before it is touched
        text = keyfile.read_text(config)
        keys = tomllib.loads(text).get("key", [])
        if not isinstance(keys, list) or not keys:
            raise ValueError(f"{config}: no [[key]] tables")
        updated, result = change(text, keys)
        gateway_config_from_dict(tomllib.loads(updated), config)
        keyfile.replace_text(config, updated)
        return result

    return _under_lock(config, run)


def _without(document: dict[str, Any], index: int, changed: dict[str, Any] | None = None) -> dict[str, Any]:
    """``document`` with its key ``index`` removed (``changed`` None) or replaced by ``changed``."""
    keys = list(document["key"])
    if changed is None:
        del keys[index]
    else:
        keys[index] = changed
    out = {k: v for k, v in document.items() if k != "key"}
    return out | ({"key": keys} if keys else {})


@keys_app.command()
def revoke(config: ConfigPath, hash_prefix: HashOption = None, name: NameOption = None) -> None:
    """Remove one key from the configuration (named by its hash or label); it stops working when the gateway
    applies the file."""

    def remove(text: str, keys: list[dict[str, Any]]) -> tuple[str, str]:
        index = _one_key(config, keys, hash_prefix, name)
        updated = keyfile.edited(
            config, text, lambda lines, spans: keyfile.remove_key(lines, spans[index]), lambda d: _without(d, index)
        )
        gone = keys[index]
        whose = f"tenant {gone.get('tenant')!r}" + (f" ({gone.get('name')})" if gone.get("name") else "")
        return updated, _printable(whose)

    whose = _guard(lambda: _edit_keys(config, remove))
    _say(f"revoked a key of {whose} in {config}. {APPLY}")


@keys_app.command()
def rotate(
    config: ConfigPath,
    hash_prefix: HashOption = None,
    name: NameOption = None,
    grace_hours: Annotated[
        float, typer.Option("--grace-hours", help="How long the old key keeps working (0: revoked at once).")
    ] = 24.0,
) -> None:
    """Make a new key for the tenant and label of an existing one and print it (once); the old one expires
    after ``--grace-hours`` (sooner if it was to expire sooner)."""
    from fairgate.gateway.auth import hash_api_key, new_api_key

    if not 0 <= grace_hours <= 8760:
        _say("error: --grace-hours: a number of hours in [0, 8760]")
        raise typer.Exit(2)
    key, now = new_api_key(), _now()

    def replace_key(text: str, keys: list[dict[str, Any]]) -> tuple[str, str]:
        index = _one_key(config, keys, hash_prefix, name)
        old = keys[index]
        ends = (now + timedelta(hours=grace_hours)).replace(microsecond=0)
        if old.get("expires") is not None:
            ends = min(ends, old["expires"])
        nl = keyfile.newline_of(text)

        def edit(lines: list[str], spans: list[keyfile.Span]) -> list[str]:
            if grace_hours == 0:
                return keyfile.remove_key(lines, spans[index])
            return keyfile.set_expiry(lines, spans[index], _toml_time(ends), nl)

        kept = None if grace_hours == 0 else old | {"expires": ends}
        updated = keyfile.edited(config, text, edit, lambda d: _without(d, index, kept))
        updated += _key_table(updated, old["tenant"], hash_api_key(key), old.get("name"), now, None)
        return updated, _printable(str(old["tenant"]))

    tenant = _guard(lambda: _edit_keys(config, replace_key))
    sys.stdout.write(key + "\n")
    sys.stdout.flush()
    old_fate = "revoked" if grace_hours == 0 else f"works {grace_hours:g} h more"
    _say(f"rotated a key of tenant {tenant!r} in {config}: the new key is above; the old one {old_fate}. {APPLY}")
