"""A gateway configuration file written from typed parts.

``GatewayFile`` holds each section as the configuration's own model (``fairgate.gateway.config``), the
``[quotas]`` table as the ledger's quota document (``fairgate.ledger.config.QuotaFile``) and ``[policy]`` as
the scenario's ``PolicyConfig``. ``text()`` serialises the values each model was given (not its defaults) with tomlkit;
``write(path)`` writes it and loads it back with ``load_gateway_config``, so a file written here is one the
gateway accepts. ``key_entries`` and ``admin_keys`` hash plain API keys for ``[[key]]`` and ``[admin]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomlkit
from pydantic import BaseModel

from fairgate.core.policies.params import PolicyConfig
from fairgate.gateway.auth import hash_api_key
from fairgate.gateway.config import (
    AdminConfig,
    DelegationConfig,
    GatewayConfig,
    GatewaySection,
    KeyConfig,
    UpstreamConfig,
    load_gateway_config,
)
from fairgate.ledger.config import QuotaFile


@dataclass(frozen=True)
class GatewayFile:
    """Every section of a gateway configuration file.

    Attributes:
        gateway: ``[gateway]`` (relative paths stay relative to the file's folder, as when loading).
        upstreams: the ``[[upstream]]`` tables, at least one.
        quotas: ``[quotas]``, the ledger's quota document.
        keys / admin / delegation / policy: ``[[key]]``, ``[admin]``, ``[delegation]``, ``[policy]`` (None:
            left out).
        comment: lines written as TOML comments at the top.

    Raises:
        ValueError: ``gateway.event_log`` is None (TOML cannot say "none"; leave the default instead).
    """

    gateway: GatewaySection
    upstreams: tuple[UpstreamConfig, ...]
    quotas: QuotaFile = field(default_factory=QuotaFile)
    keys: tuple[KeyConfig, ...] = ()
    admin: AdminConfig | None = None
    delegation: DelegationConfig | None = None
    policy: PolicyConfig | None = None
    comment: str = ""

    def __post_init__(self) -> None:
        if self.gateway.event_log is None:
            raise ValueError("gateway.event_log = None cannot be written to TOML")

    def document(self) -> dict[str, Any]:
        """The file as nested dicts: the values each section was given, by their TOML names."""
        out: dict[str, Any] = {"gateway": _dump(self.gateway)}
        if self.policy is not None:
            out["policy"] = _dump(self.policy)
        out["upstream"] = [_dump(u) for u in self.upstreams]
        out["quotas"] = _dump(self.quotas)
        if self.keys:
            out["key"] = [_dump(k) for k in self.keys]
        for name, section in (("admin", self.admin), ("delegation", self.delegation)):
            if section is not None:
                out[name] = _dump(section)
        return out

    def text(self) -> str:
        """The TOML text."""
        document = tomlkit.document()
        for line in self.comment.splitlines():
            document.add(tomlkit.comment(line))
        document.update(self.document())
        return tomlkit.dumps(document)

    def write(self, path: Path) -> GatewayConfig:
        """Write the file to ``path`` and load it back.

        Raises:
            GatewayConfigError: the gateway refuses what was written (e.g. a key naming an unknown tenant).
        """
        path.write_text(self.text())
        return load_gateway_config(path)


def _dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(by_alias=True, exclude_unset=True, exclude_none=True)


def key_entries(keys: Mapping[str, str], name: str | None = None) -> tuple[KeyConfig, ...]:
    """``[[key]]`` tables for tenant -> plain API key (hashed here), each labelled ``name``."""
    return tuple(KeyConfig(tenant=tenant, hash=hash_api_key(key), name=name) for tenant, key in keys.items())


def admin_keys(*keys: str) -> AdminConfig:
    """``[admin]`` for the plain admin ``keys`` (hashed here)."""
    return AdminConfig(key_hashes=[hash_api_key(key) for key in keys])


__all__ = ["GatewayFile", "admin_keys", "key_entries"]
