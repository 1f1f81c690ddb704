"""The audit log: one JSON line per change to the gateway's configuration, who made it and what it did.

The file is ``[gateway].audit_log`` (``GatewayConfig.audit_log_path``; default ``fairgate-audit.jsonl``
beside the configuration). Written by the admin API's writes (``fairgate.gateway.admin_api``), by every
reload (``POST /admin/reload`` and ``SIGHUP``: ``fairgate.gateway.reload``) and by ``fairgate keys``.

Keys of every record (UTF-8, one JSON object per line):

- ``v`` (``1``), ``ts`` (seconds since the epoch), ``time`` (ISO 8601 UTC, ms);
- ``actor``: who: ``admin:<hash prefix>`` (the admin key's stored hash, first 19 characters: never the
  key), ``signal:SIGHUP``, or ``cli:<user>@<host>``;
- ``action``: ``tenant.put``, ``key.add``, ``key.revoke``, ``key.rotate``, ``admin_key.add``,
  ``admin_key.revoke`` or ``config.reload``;
- ``target``: what it names (``{"tenant": ...}``; a key's ``tenant``, ``name`` and ``hash`` prefix);
- ``outcome``: ``applied`` (in force in the running gateway, and in the file), ``refused`` (nothing
  changed: ``error`` says why) or ``written`` (in the file; the gateway applies it at its next reload);
- ``error``: the one-line reason of a refusal, else ``null``;
- ``before`` / ``after``: a tenant's table before (as the gateway ran it) and after ``tenant.put``
  (``null`` for a new tenant); a key's hash prefix for the key actions; for ``config.reload``, what the
  reload changed, by place in the file (``{"quotas.tenants.acme": {...}, "key": [...]}``, each side's
  value: ``fairgate.gateway.reload_diff``; ``{}`` when nothing changed);
- ``also``: what else an admin write brought into force, being a whole configuration applied - edits made to
  the file by hand since the last reload: ``{"tenants": [names changed], "keys_added": n, "keys_removed": n}``
  (``null``: nothing else); for ``config.reload``, its answer: the keys, admin keys and tenants in force, the
  tables ``not_applied`` (a restart applies them), the upstreams added and taken out.

A record is appended with one ``write`` on an ``O_APPEND`` descriptor and synced to disk (``fsync``) before
the change is answered: an audit line is not lost to a crash that the change survives. Changes are rare
(operators' actions), so the sync costs nothing that matters.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import socket
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from starlette.requests import Request

from fairgate.gateway.auth import hash_api_key

log = logging.getLogger("fairgate.gateway")
SCHEMA_VERSION = 1
HASH_PREFIX_CHARS = 19  # "sha256$" and 12 hex digits: enough to name a key, far from enough to guess it


def cli_actor() -> str:
    """``cli:<user>@<host>``: the actor of a ``fairgate keys`` change."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container's)
        user = str(os.getuid())
    return f"cli:{user}@{socket.gethostname()}"


def record(
    action: str,
    actor: str,
    target: dict[str, Any],
    outcome: str,
    *,
    error: str | None = None,
    before: Any = None,
    after: Any = None,
    also: Any = None,
    now_s: float | None = None,
) -> dict[str, Any]:
    """One audit record (module docstring); ``now_s`` defaults to ``time.time()``."""
    now = time.time() if now_s is None else now_s
    moment = datetime.fromtimestamp(now, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return {
        "v": SCHEMA_VERSION,
        "ts": round(now, 3),
        "time": moment,
        "actor": actor,
        "action": action,
        "target": target,
        "outcome": outcome,
        "error": error,
        "before": before,
        "after": after,
        "also": also,
    }


def append(path: Path, entry: dict[str, Any]) -> None:
    """Append ``entry`` to the audit log at ``path`` as one line, synced to disk (module docstring).

    Raises:
        OSError: the file cannot be written (or ``path`` is not a regular file): the caller refuses the
            change or reports it, as the change must not go unrecorded.
    """
    if path.exists() and not path.is_file():
        raise OSError(f"{path}: the audit log is not a regular file")
    # ASCII only: a name holding U+2028 and the like stays on its line for every reader.
    line = (json.dumps(entry, default=str, ensure_ascii=True) + "\n").encode("utf-8")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def append_or_log(path: Path, entry: dict[str, Any]) -> None:
    """``append``, an error logged (with the record) instead of raised: for a change made already, which
    stands, and whose operator must hear that its line is missing."""
    try:
        append(path, entry)
    except OSError as exc:
        log.error("audit log %s not written (%s): %s", path, exc, json.dumps(entry, default=str))


def admin_actor(request: Request) -> str:
    """``admin:<hash prefix>`` of the request's admin key (``require_admin`` has checked it)."""
    key = request.headers.get("authorization", "").partition(" ")[2].strip()
    return f"admin:{hash_api_key(key)[:HASH_PREFIX_CHARS]}"


def read(path: Path) -> list[dict[str, Any]]:
    """Every record of the audit log at ``path``, oldest first (a missing file: none). Raises ``OSError``,
    ``ValueError`` (a line that is not JSON)."""
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    return [json.loads(line) for line in text.split("\n") if line.strip()]  # lines end at "\n" only


def check_writable(path: Path) -> None:
    """Raise ``OSError`` when the audit log at ``path`` cannot be appended to (checked before a change: one
    that could not be recorded is not made)."""
    if path.exists() and not path.is_file():
        raise OSError(f"{path}: the audit log is not a regular file")
    path.parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600))


__all__ = [
    "HASH_PREFIX_CHARS",
    "SCHEMA_VERSION",
    "admin_actor",
    "append",
    "append_or_log",
    "check_writable",
    "cli_actor",
    "read",
    "record",
]
