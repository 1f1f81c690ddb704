"""What a reload changed, for its audit record's ``before`` and ``after`` (``fairgate.gateway.audit``).

Both are objects keyed by where the change is in the file, holding that place's value before and after
(``null``: absent on that side), only for what changed:

- ``quotas.tenants.NAME``, ``quotas.tiers.NAME`` (a named table of ``[quotas]``, whole), ``quotas.defaults``,
  ``quotas.pricing`` and any other ``[quotas]`` table or value, as the file writes it;
- ``key``: the ``[[key]]`` tables only on that side, or changed (a new ``expires``), each as its tenant,
  label, hash prefix (``audit.HASH_PREFIX_CHARS``, never a whole hash), created and expires;
- ``admin.key_hashes``: the admin hash prefixes only on that side;
- ``delegation`` and ``access``: the table, whole (names of tenants and models, and the secret's variable
  name: no secret).

``[[upstream]]`` tables are not copied (their URLs and headers may hold credentials): the upstreams added
and taken out are named in the reload's summary (the record's ``also``).
"""

from __future__ import annotations

from typing import Any

from fairgate.gateway.audit import HASH_PREFIX_CHARS
from fairgate.gateway.config import GatewayConfig, KeyConfig

# The [quotas] tables that hold one table per name: a change is recorded per name, not as the whole table.
NAMED = ("tenants", "tiers")


def changes(before: GatewayConfig, after: GatewayConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """``before`` and ``after`` of the audit record of a reload from ``before`` to ``after`` (module
    docstring); both empty when nothing that a reload applies changed."""
    old: dict[str, Any] = {}
    new: dict[str, Any] = {}
    _quotas(before.quotas_document, after.quotas_document, old, new)
    gone, added = _keys(before.keys), _keys(after.keys)
    for side, mine, theirs in ((old, gone, added), (new, added, gone)):
        only = [key for key in mine if key not in theirs]
        if only:
            side["key"] = only
    old_admin = [h[:HASH_PREFIX_CHARS] for h in before.admin.key_hashes if h not in after.admin.key_hashes]
    new_admin = [h[:HASH_PREFIX_CHARS] for h in after.admin.key_hashes if h not in before.admin.key_hashes]
    if old_admin or new_admin:
        old["admin.key_hashes"], new["admin.key_hashes"] = old_admin, new_admin
    for table in ("delegation", "access"):
        was, now = getattr(before, table).model_dump(), getattr(after, table).model_dump()
        if was != now:
            old[table], new[table] = was, now
    return old, new


def _quotas(before: dict[str, Any], after: dict[str, Any], old: dict[str, Any], new: dict[str, Any]) -> None:
    for name in sorted(set(before) | set(after)):
        was, now = before.get(name), after.get(name)
        if was == now:
            continue
        if name in NAMED and isinstance(was or {}, dict) and isinstance(now or {}, dict):
            for item in sorted(set(was or {}) | set(now or {})):
                if (was or {}).get(item) != (now or {}).get(item):
                    old[f"quotas.{name}.{item}"] = (was or {}).get(item)
                    new[f"quotas.{name}.{item}"] = (now or {}).get(item)
        else:
            old[f"quotas.{name}"], new[f"quotas.{name}"] = was, now


def _keys(keys: list[KeyConfig]) -> list[dict[str, Any]]:
    return [
        {
            "tenant": key.tenant,
            "name": key.name,
            "hash": key.hash[:HASH_PREFIX_CHARS],
            "created": None if key.created is None else key.created.isoformat(),
            "expires": None if key.expires is None else key.expires.isoformat(),
        }
        for key in keys
    ]


__all__ = ["changes"]
