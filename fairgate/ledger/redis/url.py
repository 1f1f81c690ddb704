"""The Redis ledger's URL: ``redis://[[user]:password@]host[:6379][/db]?prefix=NAME`` (``rediss://`` for TLS).

The path is the database number (default 0). ``prefix`` (default ``fairgate``) must match
``[A-Za-z0-9_.-]{1,64}``; ``retention_days`` (default 35, in [1, 3650]) sets the keys' TTL (``keys.py``);
``timeout_s`` (default 2, in (0, 600]) bounds connecting and every reply. ``cluster`` (true | false, default
false): the host is a node of a Redis Cluster (the others are found from it; database 0 only). With
``rediss://`` only,
``ssl_cert_reqs`` (none | optional | required), ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile`` and
``ssl_check_hostname`` (true | false) configure TLS. Any other, or a repeated, query parameter is a
``ValueError``, as is any malformed part (each error one line naming it, the password hidden).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from fairgate.ledger import urls
from fairgate.ledger.text import one_line

DEFAULT_PREFIX = "fairgate"
DEFAULT_RETENTION_DAYS = 35.0
_PARAMS = ("prefix", "retention_days", "timeout_s", "cluster")
_TLS_PARAMS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname")
_TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
_PREFIX = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class RedisUrl:
    """A checked Redis ledger URL.

    Attributes:
        where: ``host:port`` for messages.
        connection: keyword arguments for redis-py's connection (host, port, db, credentials, TLS options).
    """

    prefix: str
    retention_days: float
    timeout_s: float
    tls: bool
    where: str
    connection: dict[str, Any] = field(default_factory=dict)
    cluster: bool = False  # a Redis Cluster node: every call goes to its key's hash slot


def parse_url(url: str) -> RedisUrl:
    """Check and split a ``redis://`` / ``rediss://`` ledger URL. Raises ``ValueError`` naming the part at fault."""
    parsed = urls.split(url)
    parts, shown = parsed.parts, parsed.shown
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"ledger URL {shown!r}: bad port ({one_line(exc)})") from None
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"ledger URL {shown!r}: scheme must be redis:// or rediss://, not {parts.scheme!r}")
    if not parts.hostname:
        raise ValueError(f"ledger URL {shown!r}: no host (redis://host:6379/0)")
    if parts.fragment:
        raise ValueError(f"ledger URL {shown!r}: unexpected fragment {'#' + parts.fragment!r}")
    db = _database(parts.path, shown)
    tls = parts.scheme == "rediss"
    query = _known_query(parsed, tls)
    prefix = query.get("prefix", DEFAULT_PREFIX)
    if not _PREFIX.match(prefix):
        raise ValueError(f"ledger URL: prefix {prefix!r} must match {_PREFIX.pattern}")
    retention = query.get("retention_days", str(DEFAULT_RETENTION_DAYS))
    retention_days = urls.number(retention)
    if not 1.0 <= retention_days <= 3650.0:
        raise ValueError(f"ledger URL: retention_days {retention!r} must be a number of days in [1, 3650]")
    timeout_s = urls.timeout_s(query.get("timeout_s"))
    cluster_text = query.get("cluster", "false")
    if cluster_text.lower() not in _BOOLS:
        raise ValueError(f"ledger URL: cluster {cluster_text!r} must be true or false")
    cluster = _BOOLS[cluster_text.lower()]
    if cluster and db != 0:
        raise ValueError(f"ledger URL {shown!r}: a Redis Cluster has database 0 only, not {db}")
    connection: dict[str, Any] = {"host": parts.hostname, "port": port or 6379, "db": db}
    if parts.username:
        connection["username"] = unquote(parts.username)
    if parts.password:
        connection["password"] = unquote(parts.password)
    connection.update(_tls_options(query))
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return RedisUrl(prefix, retention_days, timeout_s, tls, f"{host}:{port or 6379}", connection, cluster)


def check_url(url: str) -> None:
    """Check a Redis ledger URL without connecting (``parse_url``). Raises ``ValueError``."""
    parse_url(url)


def _database(path: str, shown: str) -> int:
    """The database number the URL's path names (none: 0)."""
    if path in ("", "/"):
        return 0
    if re.fullmatch(r"/[0-9]{1,9}", path):
        return int(path[1:])
    raise ValueError(f"ledger URL {shown!r}: the path {path!r} must be a database number (/0, /1, ...)")


def _known_query(parsed: urls.LedgerUrl, tls: bool) -> dict[str, str]:
    """The query parameters, each known, given once, and TLS ones only with ``rediss://``."""
    names, query = parsed.query()
    unknown = [name for name in names if name not in _PARAMS + _TLS_PARAMS]
    if unknown:
        raise ValueError(
            f"ledger URL {parsed.shown!r}: unknown parameter(s) {', '.join(map(repr, unknown))}; known: "
            f"{', '.join(_PARAMS)} and, with rediss://, {', '.join(_TLS_PARAMS)}"
        )
    if not tls and any(name in _TLS_PARAMS for name in names):
        given = ", ".join(name for name in names if name in _TLS_PARAMS)
        raise ValueError(f"ledger URL {parsed.shown!r}: TLS parameter(s) {given} need rediss://")
    return query


def _tls_options(query: dict[str, str]) -> dict[str, Any]:
    """redis-py's TLS options from the URL's TLS parameters (checked: files must exist)."""
    options: dict[str, Any] = {}
    if "ssl_cert_reqs" in query:
        if query["ssl_cert_reqs"] not in ("none", "optional", "required"):
            raise ValueError(f"ledger URL: ssl_cert_reqs {query['ssl_cert_reqs']!r} must be none, optional or required")
        options["ssl_cert_reqs"] = query["ssl_cert_reqs"]
    if "ssl_check_hostname" in query:
        if query["ssl_check_hostname"].lower() not in _BOOLS:
            raise ValueError(f"ledger URL: ssl_check_hostname {query['ssl_check_hostname']!r} must be true or false")
        options["ssl_check_hostname"] = _BOOLS[query["ssl_check_hostname"].lower()]
    for name in _TLS_FILES:
        if name in query:
            if not os.path.isfile(query[name]):
                raise ValueError(f"ledger URL: {name} {query[name]!r} is not a file")
            options[name] = query[name]
    return options
