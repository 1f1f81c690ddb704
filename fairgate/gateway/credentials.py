"""An upstream's credential and transport settings, checked: the API key is read from the environment
variable or file the configuration names (the configuration never holds the key itself) and kept as a
``SecretStr``, so it shows in no repr, log line, error or ``/admin`` view; extra headers may not carry
credentials or hop-by-hop fields."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import SecretStr

# Connection-level headers (RFC 9110 section 7.6.1, and those httpx sets per request): the gateway's HTTP
# client owns them; one forced on every upstream request would break framing or keep-alive.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


def header_problem(name: str, value: str) -> str | None:
    """Why ``name: value`` cannot be an upstream's extra header (None: it can)."""
    lowered = name.lower()
    if lowered == "authorization":
        return "authorization: set the key with api_key_env or api_key_file, never in the configuration"
    if lowered in HOP_BY_HOP:
        return f"{name}: a hop-by-hop header the gateway's HTTP client sets itself"
    if not name or any(c in name for c in " \t\r\n:") or not name.isascii():
        return f"{name!r}: not a header name"
    if any(c in value for c in "\r\n\x00"):
        return f"{name}: its value holds a line break or NUL"
    if not value.isascii():  # HTTP/1.1 header values are bytes: the client would fail every request on it
        return f"{name}: its value is not ASCII"
    return None


class CredentialError(ValueError):
    """An upstream key that cannot be read; the message names the key's source, never the key."""


def read_key(env: str | None, file: str | None, environ: Mapping[str, str] | None = None) -> SecretStr | None:
    """The API key from the environment variable ``env`` or the file ``file`` (its trailing newline
    stripped); None when neither is given.

    Raises:
        CredentialError: the variable is unset, the file cannot be read, or the key is empty or holds a
            character outside visible ASCII.
    """
    if env is not None:
        value = (os.environ if environ is None else environ).get(env)
        if value is None:
            raise CredentialError(f"${env} is not set")
        return valid_key(value.strip(), f"${env}")
    if file is not None:
        try:
            text = Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CredentialError(f"cannot read {file} ({getattr(exc, 'strerror', None) or exc})") from None
        return valid_key(text.rstrip("\r\n").strip(), file)
    return None


def valid_key(value: str, source: str) -> SecretStr:
    """``value`` as a key; a key that cannot be a bearer token - empty, or with a character outside visible
    ASCII (a line break in its middle, a space, a letter with an accent) - is refused naming ``source``,
    never showing the key (an HTTP client's error about it would quote it to every tenant)."""
    if not value:
        raise CredentialError(f"{source} is empty")
    if not all("!" <= c <= "~" for c in value):
        raise CredentialError(f"{source}: the key holds a character outside visible ASCII (a line break, space, ...)")
    return SecretStr(value)


__all__ = ["HOP_BY_HOP", "CredentialError", "header_problem", "read_key", "valid_key"]
