"""``fairgate keys ...``: make and list the gateway's API keys (only their hashes are stored).

``fairgate keys add TENANT --config fairgate.toml [--name LABEL]`` appends a ``[[key]]`` table to the
configuration (its comments and layout stay as they are) and prints the new key once on stdout.
``fairgate keys list --config fairgate.toml`` prints tenants, labels and hash prefixes, never keys.
Every user error prints one line on stderr and exits with code 2.
"""

from __future__ import annotations

import os
import sys
import tempfile
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, TypeVar

import typer
from rich.console import Console

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
    except (GatewayConfigError, OSError, ValueError) as exc:
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


def _replace_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a temporary file beside it, then rename), keeping its mode."""
    mode = path.stat().st_mode & 0o7777
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


@keys_app.command()
def add(
    tenant: Annotated[str, typer.Argument(help="A tenant of the quotas.tenants table.")],
    config: ConfigPath,
    name: Annotated[str | None, typer.Option("--name", help="A label for the key (e.g. where it is used).")] = None,
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
        key = new_api_key()
        text = config.read_text(encoding="utf-8")
        table = f"\n[[key]]\ntenant = {toml_string(tenant)}\nhash = {toml_string(hash_api_key(key))}\n"
        if name is not None:
            table += f"name = {toml_string(name)}\n"
        updated = text + ("" if text.endswith("\n") or not text else "\n") + table
        try:
            data = tomllib.loads(updated)
        except tomllib.TOMLDecodeError as exc:
            raise GatewayConfigError(
                f"{config}: cannot append a [[key]] table here ({exc}); is `key` defined another way in this file?"
            ) from None
        gateway_config_from_dict(data, config)  # the file as it will be, before writing it
        _replace_text(config, updated)
        return key

    key = _guard(run)
    sys.stdout.write(key + "\n")
    sys.stdout.flush()
    label = f" ({name})" if name else ""
    _say(
        f"added a key for tenant {tenant!r}{label} to {config}; it is printed above and cannot be shown again "
        "(only its hash is stored). Restart the gateway to use it."
    )


@keys_app.command("list")
def list_keys(config: ConfigPath) -> None:
    """Print the tenant, label and hash prefix of every key and admin credential (never a key)."""
    from fairgate.gateway.config import load_gateway_config

    loaded = _guard(lambda: load_gateway_config(config))
    rows = [(k.tenant, k.name or "-", k.hash[:23] + "...") for k in loaded.keys]
    rows += [("(admin)", "-", h[:23] + "...") for h in loaded.admin.key_hashes]
    if not rows:
        _say(f"no keys in {config}; make one with: fairgate keys add TENANT --config {config}")
        return
    widths = [max(len(row[i]) for row in [("tenant", "name", "hash"), *rows]) for i in range(2)]
    for row in [("tenant", "name", "hash"), *rows]:
        sys.stdout.write(f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]}\n")


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
        document = tomlkit.parse(config.read_text(encoding="utf-8"))  # comments and layout kept
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
        _replace_text(config, updated)
        return key

    key = _guard(run)
    sys.stdout.write(key + "\n")
    sys.stdout.flush()
    _say(
        f"added an admin key to {config}; it is printed above and cannot be shown again (only its hash is "
        "stored). Restart the gateway to use it."
    )
