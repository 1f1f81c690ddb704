"""Editing the ``[[key]]`` tables of a gateway configuration as text, safely: what ``fairgate keys`` uses.

- **As text, not re-serialised**: a table is removed or changed where it stands, with the comments directly
  above its header; every other line, comment, blank line and line ending stays byte for byte. (A TOML
  document library regroups an array of tables when one is removed, and moves comments to other tables.)
  Every edit is verified: the edited text must parse to exactly the document expected, else nothing is
  written.
- **One writer at a time**: ``locked`` holds an exclusive ``flock`` on a lock file beside the configuration
  for the whole read-change-write, so two commands at once cannot lose each other's change (a revoke that
  said "revoked" but was overwritten by a concurrent add).
- **Atomic, in place**: ``replace_text`` writes a temporary file beside the real file (a symlinked
  configuration is followed, not replaced by a copy), with the file's mode and owner, then renames it over.
"""

from __future__ import annotations

import fcntl
import os
import re
import tempfile
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

_TABLE_HEADER = re.compile(r"^[ \t]*\[")  # a table or array-of-tables header (checked by parsing, below)
_KEY_HEADER = re.compile(r"^[ \t]*\[\[[ \t]*key[ \t]*\]\][ \t]*(#.*)?$")
_COMMENT = re.compile(r"^[ \t]*#")
_EXPIRES = re.compile(r"^[ \t]*expires[ \t]*=")


class KeyFileError(ValueError):
    """The configuration cannot be edited safely (its message names the file and why)."""


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on the configuration ``path`` (a hidden ``.NAME.lock`` beside it) while the block runs."""
    real = path.resolve()
    with open(real.parent / f".{real.name}.lock", "a", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def lock(path: Path) -> IO[str]:
    """Take the exclusive lock ``locked`` holds (blocking) and return its handle, for ``unlock``: for a caller
    that holds it across steps run in different threads (an flock belongs to the open file, not a thread)."""
    real = path.resolve()
    handle = open(real.parent / f".{real.name}.lock", "a", encoding="utf-8")  # noqa: SIM115 - unlock closes it
    fcntl.flock(handle, fcntl.LOCK_EX)
    return handle


def unlock(handle: IO[str]) -> None:
    """Release a ``lock``."""
    try:
        fcntl.flock(handle, fcntl.LOCK_UN)
    finally:
        handle.close()


@dataclass
class Staged:
    """A file's new text written beside it (``stage``), not yet in its place: ``commit`` renames it over the
    file, ``discard`` deletes it."""

    temporary: Path
    target: Path

    def commit(self) -> None:
        """Put the new text in place (one rename). Raises ``OSError`` (the temporary file is deleted then)."""
        try:
            os.replace(self.temporary, self.target)
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        self.temporary.unlink(missing_ok=True)


def stage(path: Path, text: str) -> Staged:
    """Write ``text`` beside ``path``, with its mode and, where allowed, owner (see module docstring), ready
    to ``commit``. Raises ``OSError``: the folder is not writable, or the file is not (its mode says so)."""
    real = path.resolve()
    status = real.stat()
    if not os.access(real, os.W_OK):
        raise PermissionError(f"{path}: the file is not writable (mode {status.st_mode & 0o777:o})")
    handle, temporary = tempfile.mkstemp(prefix=f".{real.name}.", suffix=".tmp", dir=real.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8", newline="") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temporary, status.st_mode & 0o7777)
        if (status.st_uid, status.st_gid) != (os.geteuid(), os.getegid()):
            try:
                os.chown(temporary, status.st_uid, status.st_gid)
            except PermissionError:
                pass  # not ours to give away: the file becomes the editor's, as any editor would leave it
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return Staged(Path(temporary), real)


def replace_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (see module docstring), keeping its mode and, where allowed, owner."""
    stage(path, text).commit()


def read_text(path: Path) -> str:
    """The configuration's text, line endings as they are."""
    with open(path, encoding="utf-8", newline="") as handle:
        return handle.read()


@dataclass(frozen=True)
class Span:
    """A ``[[key]]`` table's lines: ``start`` (its leading comments) .. ``end`` (exclusive); ``header`` its
    header line; ``last`` the last line that holds one of its keys."""

    start: int
    header: int
    last: int
    end: int


def key_spans(lines: list[str]) -> list[Span]:
    """The ``[[key]]`` tables of ``lines`` in file order."""
    headers = [i for i, line in enumerate(lines) if _TABLE_HEADER.match(line)]
    spans = []
    for n, header in enumerate(headers):
        if not _KEY_HEADER.match(lines[header].rstrip("\r\n")):
            continue
        end = headers[n + 1] if n + 1 < len(headers) else len(lines)
        last = end - 1
        while last > header and (not lines[last].strip() or _COMMENT.match(lines[last])):
            last -= 1  # the comments and blank lines before the next header are the next table's
        start = header
        while start > 0 and _COMMENT.match(lines[start - 1]):
            start -= 1
        spans.append(Span(start, header, last, last + 1 if end == len(lines) else _next_start(lines, last, end)))
    return spans


def _next_start(lines: list[str], last: int, end: int) -> int:
    """Where the lines after a table's ``last`` stop being its own: the next header's leading comments."""
    start = end
    while start > last + 1 and _COMMENT.match(lines[start - 1]):
        start -= 1
    return start


def edited(
    path: Path, text: str, edit: Callable[[list[str], list[Span]], list[str]], expect: Callable[[Any], Any]
) -> str:
    """``edit`` applied to the lines of ``text`` (with its key spans), verified: the result must parse to
    ``expect(parsed text)``. Raises ``KeyFileError``: keys not written as ``[[key]]`` tables, or an edit
    whose result is not the document expected (an unusual layout)."""
    lines = text.splitlines(keepends=True)
    document = tomllib.loads(text)
    spans = key_spans(lines)
    if len(spans) != len(document.get("key", [])):
        raise KeyFileError(
            f"{path}: key: the keys are not all [[key]] tables; write them as [[key]] tables to edit them here"
        )
    result = "".join(edit(lines, spans))
    try:
        check = tomllib.loads(result) == expect(document)
    except tomllib.TOMLDecodeError:
        check = False
    if not check:
        raise KeyFileError(f"{path}: key: cannot edit this file's [[key]] tables safely; edit it by hand")
    return result


def newline_of(text: str) -> str:
    return "\r\n" if "\r\n" in text else "\n"


def remove_key(lines: list[str], span: Span) -> list[str]:
    """``lines`` without the table ``span`` (and its leading comments)."""
    return lines[: span.start] + lines[span.end :]


def set_expiry(lines: list[str], span: Span, when: str, newline: str) -> list[str]:
    """``lines`` with the table ``span``'s ``expires`` set to the TOML date-time ``when``."""
    out = list(lines)
    for i in range(span.header + 1, span.last + 1):
        if _EXPIRES.match(out[i]):
            out[i] = f"expires = {when}{newline}"
            return out
    tail = out[span.last]
    if not tail.endswith(("\n", "\r")):
        out[span.last] = tail + newline
    out.insert(span.last + 1, f"expires = {when}{newline}")
    return out


__all__ = [
    "KeyFileError",
    "edited",
    "key_spans",
    "locked",
    "newline_of",
    "read_text",
    "remove_key",
    "replace_text",
    "set_expiry",
]
