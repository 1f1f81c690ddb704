"""``fairgate keys ...``: make, list, revoke and rotate the gateway's API keys (only their hashes are stored).

``fairgate keys add TENANT --config fairgate.toml [--name LABEL] [--expires-in-days D]`` appends a ``[[key]]``
table to the configuration (its comments and layout stay as they are), stamped with its ``created`` time
(and ``expires``), and prints the new key once on stdout. ``fairgate keys list --config fairgate.toml``
prints tenants, labels, hash prefixes, created and expiry times, never keys. ``fairgate keys revoke`` removes
one key, named by a prefix of its hash (as ``list`` shows it) or by its label; ``fairgate keys revoke-admin
--hash PREFIX`` removes one hash from ``[admin].key_hashes``; ``fairgate keys rotate`` makes
a new key for the same tenant and label and lets the old one work ``--grace-hours`` more (0: revoked now).
The gateway applies the file on ``SIGHUP`` or ``POST /admin/reload`` (``fairgate.gateway.reload``).
Every user error prints one line on stderr and exits with code 2.
"""

from __future__ import annotations

import sys
import tomllib
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from fairgate.gateway import audit, config_edit

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


APPLY = "Send the gateway SIGHUP (kill -HUP <pid>) or POST /admin/reload to apply it."


def _shown(moment: datetime | None) -> str:
    return "-" if moment is None else config_edit.toml_time(moment)


def _expiry(moment: datetime | None, now: datetime) -> str:
    return _shown(moment) + (" (expired)" if moment is not None and moment <= now else "")


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
    if name is not None and len(name) > config_edit.KEY_NAME_MAX:
        _say(f"error: --name: at most {config_edit.KEY_NAME_MAX} characters")
        raise typer.Exit(2)
    if expires_in_days is not None and not 0 < expires_in_days <= config_edit.EXPIRES_IN_DAYS_MAX:
        _say(f"error: --expires-in-days: a number of days in (0, {config_edit.EXPIRES_IN_DAYS_MAX}]")
        raise typer.Exit(2)
    made = _guard(lambda: config_edit.add_key(config, tenant, name, expires_in_days))
    _audit(config, "key.add", {"tenant": tenant, "name": name}, after={"hash": made.hash[: audit.HASH_PREFIX_CHARS]})
    key = made.key
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
    now = config_edit.now_s()
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
    from fairgate.gateway.config import GatewayConfigError

    key = new_api_key()

    def change(text: str) -> tuple[str, None]:
        document = tomlkit.parse(text)  # comments and layout kept
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
        return tomlkit.dumps(document), None

    _guard(lambda: config_edit.edit(config, change))
    _audit(config, "admin_key.add", {}, after={"hash": hash_api_key(key)[: audit.HASH_PREFIX_CHARS]})
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


def _ref(key: config_edit.KeyRef) -> dict[str, Any]:
    return {"tenant": key.tenant, "name": key.name, "hash": key.hash[: audit.HASH_PREFIX_CHARS]}


def _audit(config: Path, action: str, target: dict[str, Any], before: Any = None, after: Any = None) -> None:
    """One ``written`` record in the configuration's audit log (``fairgate.gateway.audit``): the change is in
    the file, the gateway applies it at its next reload. A log that cannot be written is a warning: the
    change is made."""
    from fairgate.gateway.config import GatewayConfigError, load_gateway_config

    try:
        path = load_gateway_config(config).audit_log_path
        audit.append(path, audit.record(action, audit.cli_actor(), target, "written", before=before, after=after))
    except (OSError, GatewayConfigError) as exc:
        _say(f"warning: the audit log was not written: {exc}")


def _one_of(hash_prefix: str | None, name: str | None) -> None:
    if (hash_prefix is None) == (name is None):
        _say("error: name the key with --hash PREFIX or --name LABEL (one of them)")
        raise typer.Exit(2)


@keys_app.command()
def revoke(config: ConfigPath, hash_prefix: HashOption = None, name: NameOption = None) -> None:
    """Remove one key from the configuration (named by its hash or label); it stops working when the gateway
    applies the file."""
    _one_of(hash_prefix, name)
    gone = _guard(lambda: config_edit.revoke_key(config, hash_prefix, name))
    _audit(config, "key.revoke", {"hash": hash_prefix, "name": name}, before=_ref(gone))
    whose = f"tenant {gone.tenant!r}" + (f" ({gone.name})" if gone.name else "")
    _say(f"revoked a key of {_printable(whose)} in {config}. {APPLY}")


@keys_app.command("revoke-admin")
def revoke_admin(
    config: ConfigPath,
    hash_prefix: Annotated[
        str, typer.Option("--hash", help="The admin key's hash, or its first 12+ characters (as `keys list` shows).")
    ],
) -> None:
    """Remove one admin key hash from ``\\[admin].key_hashes``; that admin key stops working when the gateway
    applies the file."""
    gone = _guard(lambda: config_edit.revoke_admin_key(config, hash_prefix))
    _audit(config, "admin_key.revoke", {"hash": hash_prefix}, before={"hash": gone[: audit.HASH_PREFIX_CHARS]})
    _say(f"revoked the admin key {gone[:23]}... in {config}. {APPLY}")


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
    if not 0 <= grace_hours <= 8760:
        _say("error: --grace-hours: a number of hours in [0, 8760]")
        raise typer.Exit(2)
    _one_of(hash_prefix, name)
    new, old, _ = _guard(lambda: config_edit.rotate_key(config, hash_prefix, name, grace_hours))
    target = {"hash": hash_prefix, "name": name, "grace_hours": grace_hours}
    _audit(config, "key.rotate", target, before=_ref(old), after={"hash": new.hash[: audit.HASH_PREFIX_CHARS]})
    key, tenant = new.key, _printable(old.tenant)
    sys.stdout.write(key + "\n")
    sys.stdout.flush()
    old_fate = "revoked" if grace_hours == 0 else f"works {grace_hours:g} h more"
    _say(f"rotated a key of tenant {tenant!r} in {config}: the new key is above; the old one {old_fate}. {APPLY}")
