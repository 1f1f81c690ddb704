"""Reading a TOML configuration file with one-line errors naming the file (scenarios, quotas, gateway)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from fairgate.inputfile import open_regular

MAX_CONFIG_BYTES = 10 * 1024 * 1024


def read_toml(path: str | Path, error: type[Exception], what: str) -> dict[str, Any]:
    """The TOML document at ``path``.

    Raises:
        ``error``: not a regular file, larger than 10 MiB, missing, unreadable, not UTF-8 or not TOML;
            the message is one line starting with the path (``what`` names the kind of file).
    """
    with open_regular(path, error, f"a {what}", MAX_CONFIG_BYTES) as handle:
        try:
            return tomllib.load(handle)
        except tomllib.TOMLDecodeError as exc:
            raise error(f"{path}: not valid TOML: {exc}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise error(f"{path}: cannot read: {exc}") from None
