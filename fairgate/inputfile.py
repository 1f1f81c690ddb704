"""Opening an input file (a configuration, a trace, a request log) with one-line errors that start with its
name: missing, a directory, not a regular file, too large or unreadable.

The file is opened non-blocking and checked with ``fstat`` on the open descriptor: a FIFO would block
``open`` and a device such as ``/dev/zero`` never ends, and a check by name before opening would pass a
regular file that something replaced between the check and the open.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)


def _size(n_bytes: int) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n_bytes >= scale and n_bytes % scale == 0:
            return f"{n_bytes // scale} {unit}"
    return f"{n_bytes:,} bytes"


def open_regular(
    path: str | Path, error: type[Exception], what: str, max_bytes: int | None = None, label: str | None = None
) -> BinaryIO:
    """``path`` opened for reading in binary mode (the caller closes it).

    Args:
        error: the exception class raised, with a one-line message starting with ``label`` (default: the path).
        what: what the file should be, for the message on a directory ("a request log").
        max_bytes: the largest size accepted (None: any).

    Raises:
        ``error``: the file is missing, a directory, not a regular file, larger than ``max_bytes`` or cannot
            be opened.
    """
    label = str(path) if label is None else label
    try:
        fd = os.open(path, _FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        raise error(f"{label}: file not found") from None
    except (OSError, ValueError) as exc:
        raise error(f"{label}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        mode, size = _stat(fd)
        if stat.S_ISDIR(mode):
            raise error(f"{label}: is a directory, not {what}")
        if not stat.S_ISREG(mode):
            raise error(f"{label}: not a regular file")
        if max_bytes is not None and size > max_bytes:
            raise error(f"{label}: too large ({size:,} bytes; the cap is {_size(max_bytes)})")
        return open(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _stat(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_mode, st.st_size
