"""Reload the configuration without a restart: on ``SIGHUP`` and on ``POST /admin/reload`` (admin key).

The file the gateway was started with is read and validated again, whole. What takes effect at once is who
may call, and with which models: the ``[[key]]`` tables (keys added, revoked, rotated, expiring), ``[admin]``,
``[delegation]`` and ``[access]``;
requests in flight, streams included, are not touched (a request is authenticated once, when it arrives).
A change anywhere else (``[gateway]``, upstreams, models, policy, quotas) is not applied - the ledger, the
queues and the meters hold state built from them - and is named in the answer and the log line, to apply
with a restart. A file that does not load, that changes while it is read, that would leave no key at all
(a file caught half written), or whose keys name a tenant the running gateway does not have, is refused
with its one-line error and the running configuration stays.

Every reload logs one JSON line on the ``fairgate.gateway`` logger: ``config_reloaded`` (WARNING, the level
``fairgate serve`` shows: an operator wants to see that the signal was taken) or ``config_reload_refused``
(ERROR).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from fairgate.gateway.config import GatewayConfig, GatewayConfigError, load_gateway_config
from fairgate.gateway.identity import Identity, require_admin
from fairgate.gateway.outcomes import Outcome, Rejection
from fairgate.gateway.state import GatewayState, gateway_of

log = logging.getLogger("fairgate.gateway")

APPLIED = ("key", "admin", "delegation", "access")
# The other top-level tables, as ``GatewayConfig`` fields: compared to say what a restart would change.
NEEDS_RESTART = {
    "gateway": "gateway",
    "upstream": "upstreams",
    "model": "models",
    "policy": "policy",
    "telemetry": "telemetry",
}


@dataclass(frozen=True)
class Reloaded:
    """What a reload applied: the tenant and admin keys that work now, and the tables changed in the file
    but not applied (a restart applies them)."""

    keys: int
    admin_keys: int
    not_applied: tuple[str, ...]


def reload_identity(state: GatewayState) -> Reloaded:
    """Read ``state.config.path`` again and apply its keys, admin keys and delegation (module docstring).

    Raises:
        GatewayConfigError: the file does not load (its one-line message), or a key names a tenant the
            running gateway does not have.
    """
    running = state.config
    before = _fingerprint(running.path)
    new = load_gateway_config(running.path)
    if _fingerprint(running.path) != before:
        raise GatewayConfigError(f"{running.path}: the file changed while it was read; reload again when it is written")
    new.delegation_secret()  # a secret too short is refused here, not at each delegated request
    if (running.keys or running.admin.key_hashes) and not (new.keys or new.admin.key_hashes):
        raise GatewayConfigError(
            f"{running.path}: key: no [[key]] and no admin key: applied, it would lock every caller out "
            "(a file half written?); the running keys stay"
        )
    names = list(new.access.default or [])  # a copy: the list is the new config's own
    names += [name for access in new.access.tenants.values() for name in access.models]
    absent = sorted(set(names) - set(running.served))
    if absent:  # checked against the models the file names; those running may differ until a restart
        raise GatewayConfigError(
            f"{running.path}: access: {absent[0]!r} is not a model of the running gateway (a new model needs a "
            "restart, then [access] can name it)"
        )
    unknown = sorted({key.tenant for key in new.keys} - set(running.quotas.tenants))
    if unknown:
        raise GatewayConfigError(
            f"{running.path}: key: tenant {unknown[0]!r} is not a tenant of the running gateway "
            "(a new tenant is applied by a restart)"
        )
    update = {"keys": new.keys, "admin": new.admin, "delegation": new.delegation, "access": new.access}
    merged = running.model_copy(update=update)
    identity = Identity(merged, state.clock.wall_s)  # built whole before it replaces the running one
    state.config, state.identity = merged, identity
    return Reloaded(identity.keys, len(new.admin.key_hashes), _not_applied(running, new))


def _fingerprint(path: Path) -> tuple[int, int, int]:
    """What changes when a file is written: its size, modification time and inode (0s: it does not exist)."""
    try:
        status = path.stat()
    except OSError:
        return (0, 0, 0)
    return (status.st_size, status.st_mtime_ns, status.st_ino)


def _not_applied(running: GatewayConfig, new: GatewayConfig) -> tuple[str, ...]:
    changed = [table for table, name in NEEDS_RESTART.items() if getattr(running, name) != getattr(new, name)]
    if running.quotas_document != new.quotas_document:
        changed.append("quotas")
    return tuple(changed)


def reload_and_log(state: GatewayState) -> Reloaded:
    """``reload_identity``, logged (module docstring). Raises ``GatewayConfigError`` as it does."""
    try:
        reloaded = reload_identity(state)
    except GatewayConfigError as exc:
        log.error(json.dumps({"event": "config_reload_refused", "error": str(exc)}))
        raise
    line = {"event": "config_reloaded", "applied": list(APPLIED), **asdict(reloaded)}
    if reloaded.not_applied:
        line["note"] = "restart to apply the tables in not_applied"
    log.warning(json.dumps(line))
    return reloaded


def install(app: FastAPI, state: GatewayState) -> None:
    """``POST /admin/reload`` on ``app``, and around its lifespan a ``SIGHUP`` handler (when the gateway runs
    on the main thread, as ``fairgate serve`` does; a signal cannot reach another thread's loop)."""

    @app.post("/admin/reload", dependencies=[Depends(require_admin)], tags=["admin"])
    async def reload(request: Request) -> JSONResponse:
        try:
            reloaded = reload_and_log(gateway_of(request))
        except GatewayConfigError as exc:
            raise Rejection(Outcome.CONFIG_INVALID, str(exc)) from None
        return JSONResponse({"applied": list(APPLIED), **asdict(reloaded)})

    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(running: Any) -> AsyncIterator[Any]:
        async with inner(running) as inner_state:
            on_main = threading.current_thread() is threading.main_thread()
            loop = asyncio.get_running_loop()
            if on_main:
                loop.add_signal_handler(signal.SIGHUP, _on_hangup, state)
            try:
                yield inner_state
            finally:
                if on_main:
                    loop.remove_signal_handler(signal.SIGHUP)

    app.router.lifespan_context = lifespan


def _on_hangup(state: GatewayState) -> None:
    try:
        reload_and_log(state)
    except GatewayConfigError:
        pass  # logged; the running configuration stays


__all__ = ["APPLIED", "Reloaded", "install", "reload_and_log", "reload_identity"]
