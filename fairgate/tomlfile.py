"""Reading a TOML configuration file with one-line errors naming the file (scenarios, quotas, gateway)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

MAX_CONFIG_BYTES = 10 * 1024 * 1024


def read_toml(path: str | Path, error: type[Exception], what: str) -> dict[str, Any]:
    """The TOML document at ``path``.

    Raises:
        ``error``: not a regular file, larger than 10 MiB, missing, unreadable, not UTF-8 or not TOML;
            the message is one line starting with the path (``what`` names the kind of file).
    """
    path = Path(path)
    if path.exists() and not path.is_dir() and not path.is_file():
        raise error(f"{path}: not a regular file")
    if path.is_file() and path.stat().st_size > MAX_CONFIG_BYTES:
        raise error(f"{path}: larger than 10 MiB; not a {what}")
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise error(f"{path}: file not found") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory, expected a TOML file") from None
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{path}: not valid TOML: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{path}: cannot read: {exc}") from None
