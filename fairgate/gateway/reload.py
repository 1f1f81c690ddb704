"""Reload the configuration without a restart: on ``SIGHUP`` and on ``POST /admin/reload`` (admin key).

The file the gateway was started with is read and validated again, whole. What takes effect at once is who
may call, with which models, and within which limits: the ``[[key]]`` tables (keys added, revoked, rotated,
expiring), ``[admin]``, ``[delegation]``, ``[access]`` and ``[quotas]`` - tiers, limits, model classes,
weights, prices, and new tenants - and the ``[[upstream]]`` replicas of the running models, added and taken out
(``fairgate.gateway.upstream_reload``: one taken out finishes its requests first). Requests in flight, streams
included, are not touched: a request is authenticated once, when it arrives, and its reservation is settled
under the limits in force when each settlement is booked (``Ledger.apply_quotas``). A weight applies to what the
fair policy charges from then on; the GPU time a tenant was charged stays
(``fairgate.core.policies.factory.reshare``).

A change anywhere else (``[gateway]``, models, policy, telemetry) is not applied - the queues,
the meters and the upstream clients are built from them - and is named in the answer and the log line, to
apply with a restart. Refused with its one-line error, the running configuration kept whole: a file that does
not load, that changes while it is read, that would leave no key at all (a file caught half written), that
drops a tenant (its reservations are still open: revoke its keys to stop it, then restart), that adds or
removes a tenant's model class table (its open reservations were charged to the tables in force; a class's
limits change on reload), that sets a spend budget while a class the running gateway charges has no price
(prices change on reload: a request in flight settles at the price it was admitted at), that moves a tenant
to another priority pool or names one not in use, a model class or ``[access]`` name the running models lack, or
a short delegation secret.

Each process applies its own file: on a shared ledger, reload every process (``deploy/kubernetes`` has a
recipe); until then each checks reservations against the limits it holds.

Every reload logs one JSON line on the ``fairgate.gateway`` logger: ``config_reloaded`` (WARNING, the level
``fairgate serve`` shows: an operator wants to see that the signal was taken) or ``config_reload_refused``
(ERROR), and appends one ``config.reload`` record to the audit log (``fairgate.gateway.audit``): what changed
before and after (``fairgate.gateway.reload_diff``), and the answer's summary as ``also``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from fairgate.core.policies.factory import TenantShare, reshare
from fairgate.gateway import audit, reload_diff, upstream_reload
from fairgate.gateway.config import GatewayConfig, GatewayConfigError, load_gateway_config
from fairgate.gateway.identity import Identity, require_admin
from fairgate.gateway.outcomes import Outcome, Rejection
from fairgate.gateway.state import GatewayState, gateway_of

log = logging.getLogger("fairgate.gateway")

APPLIED = ("key", "admin", "delegation", "access", "quotas", "upstream")
APPLIED_FIELDS = ("keys", "admin", "delegation", "access", "quotas_document", "upstreams")
# The other top-level tables, as ``GatewayConfig`` fields: compared to say what a restart would change.
NEEDS_RESTART = {"gateway": "gateway", "model": "models", "policy": "policy", "telemetry": "telemetry"}


@dataclass(frozen=True)
class Reloaded:
    """What a reload applied: the tenant and admin keys that work now, the tenants configured, the tables
    changed in the file but not applied (a restart applies them), and the upstreams added (or serving again)
    and taken out (they drain their requests first)."""

    keys: int
    admin_keys: int
    tenants: int
    not_applied: tuple[str, ...]
    upstreams_added: tuple[str, ...] = ()
    upstreams_removed: tuple[str, ...] = ()


def reload_config(state: GatewayState) -> Reloaded:
    """Read ``state.config.path`` again and apply the tables of ``APPLIED`` (module docstring).

    Raises:
        GatewayConfigError: the file does not load (its one-line message), or it asks for what a reload
            cannot apply (module docstring); nothing is changed then.
    """
    return apply_config(state, _read_whole(state.config.path))


def apply_config(state: GatewayState, new: GatewayConfig) -> Reloaded:
    """Apply the tables of ``APPLIED`` of ``new`` (a whole configuration, validated) to the running gateway,
    all of them or, raising, none (module docstring). Raises ``GatewayConfigError``."""
    running = state.config
    new.delegation_secret()  # a secret too short is refused here, not at each delegated request
    _check_keys(running, new)
    _check_models(running, new)
    _check_tenants(running, new)
    upstreams = upstream_reload.plan(state, new)
    shares = {name: TenantShare(t.weight, t.priority) for name, t in new.quotas.tenants.items()}
    merged = running.with_tables(new, APPLIED_FIELDS)
    identity = Identity(merged, state.clock.wall_s)  # built whole before it replaces the running one
    try:
        for pool in state.dispatcher.models():  # every pool's policy has the same shape: the first refuses
            reshare(state.dispatcher.policy(pool), shares)
    except ValueError as exc:
        raise GatewayConfigError(f"{running.path}: quotas: {exc}") from None
    state.backend.apply_quotas(new.quotas)
    upstream_reload.apply(state, upstreams)
    state.config, state.identity = merged, identity
    for listener in state.on_reload:
        listener(merged)
    return Reloaded(
        identity.keys,
        len(new.admin.key_hashes),
        len(new.quotas.tenants),
        _not_applied(running, new),
        (*upstreams.revived, *(table.name for table in upstreams.added)),
        upstreams.removed,
    )


def restore(state: GatewayState, previous: GatewayConfig) -> None:
    """Put back ``previous``, the configuration that ran before one just applied (an admin write whose file
    could not be put in place), with no check: it ran."""
    shares = {name: TenantShare(t.weight, t.priority) for name, t in previous.quotas.tenants.items()}
    for pool in state.dispatcher.models():
        with suppress(ValueError):  # a tenant added meanwhile keeps its pool; its weight goes back to 1
            reshare(state.dispatcher.policy(pool), shares)
    state.backend.apply_quotas(previous.quotas)
    upstream_reload.undo(state, previous)
    state.config, state.identity = previous, Identity(previous, state.clock.wall_s)
    for listener in state.on_reload:
        listener(previous)


def _read_whole(path: Path) -> GatewayConfig:
    """The configuration at ``path``, read when nothing writes it. Raises ``GatewayConfigError``."""
    before = _fingerprint(path)
    new = load_gateway_config(path)
    if _fingerprint(path) != before:
        raise GatewayConfigError(f"{path}: the file changed while it was read; reload again when it is written")
    return new


def _check_keys(running: GatewayConfig, new: GatewayConfig) -> None:
    if (running.keys or running.admin.key_hashes) and not (new.keys or new.admin.key_hashes):
        raise GatewayConfigError(
            f"{running.path}: key: no [[key]] and no admin key: applied, it would lock every caller out "
            "(a file half written?); the running keys stay"
        )


def _check_models(running: GatewayConfig, new: GatewayConfig) -> None:
    """``[access]`` and the tenants' model classes name what the running gateway serves (its models can
    differ from the file's until a restart)."""
    names = list(new.access.default or [])  # a copy: the list is the new config's own
    names += [name for access in new.access.tenants.values() for name in access.models]
    absent = sorted(set(names) - set(running.served))
    if absent:
        raise GatewayConfigError(
            f"{running.path}: access: {absent[0]!r} is not a model of the running gateway (a new model needs a "
            "restart, then [access] can name it)"
        )
    classes = {served.quota_class for served in running.served.values()}
    unpriced = sorted(classes - set(new.quotas.prices))
    if new.quotas.spend_limited and unpriced:
        raise GatewayConfigError(
            f"{running.path}: quotas.pricing.model_class: the running gateway charges class {unpriced[0]!r}, which "
            "has no price while a spend_budget is set (its requests would run free of every budget)"
        )
    for tenant in new.quotas.tenants.values():
        unknown = sorted(set(tenant.by_model_class) - classes)
        if unknown:
            raise GatewayConfigError(
                f"{running.path}: quotas.tenants.{tenant.name}.model_class.{unknown[0]}: no model of the running "
                "gateway is charged to that class (a new model needs a restart)"
            )


def _check_tenants(running: GatewayConfig, new: GatewayConfig) -> None:
    gone = sorted(set(running.quotas.tenants) - set(new.quotas.tenants))
    if gone:
        raise GatewayConfigError(
            f"{running.path}: quotas.tenants: tenant {gone[0]!r} is gone from the file; a tenant is removed by a "
            "restart (its reservations may be open); to stop it now, revoke its keys and reload"
        )
    for name, quota in running.quotas.tenants.items():
        # A reservation is settled, cancelled and expired on the accounts its tenant's tables name when it
        # closes: one made before a class table came (or went) would release a slot it never took (or keep
        # one it took for good). Its limits may change; the tables themselves wait for a restart.
        moved = sorted(set(quota.by_model_class) ^ set(new.quotas.tenants[name].by_model_class))
        if moved:
            raise GatewayConfigError(
                f"{running.path}: quotas.tenants.{name}.model_class.{moved[0]}: a model class table added or "
                "removed is applied by a restart only (open reservations were charged to the accounts of the "
                "tables in force); its limits can change on reload"
            )


def _fingerprint(path: Path) -> tuple[int, int, int]:
    """What changes when a file is written: its size, modification time and inode (0s: it does not exist)."""
    try:
        status = path.stat()
    except OSError:
        return (0, 0, 0)
    return (status.st_size, status.st_mtime_ns, status.st_ino)


def _not_applied(running: GatewayConfig, new: GatewayConfig) -> tuple[str, ...]:
    changed = [table for table, name in NEEDS_RESTART.items() if getattr(running, name) != getattr(new, name)]
    before, after = running.policy_spec(), new.policy_spec()
    if "policy" not in changed and before.params.get(before.name) != after.params.get(before.name):
        changed.append("policy")  # slot_cap's default share, made from the replicas and tenants at start
    return tuple(changed)


def reload_and_log(state: GatewayState, actor: str) -> Reloaded:
    """``reload_config``, logged and audited as done by ``actor`` (module docstring; ``fairgate.gateway.audit``).
    Raises ``GatewayConfigError`` as it does."""
    target = {"path": str(state.config.path)}
    previous = state.config
    try:
        reloaded = reload_config(state)
    except GatewayConfigError as exc:
        log.error(json.dumps({"event": "config_reload_refused", "error": str(exc)}))
        entry = audit.record("config.reload", actor, target, "refused", error=str(exc))
        audit.append_or_log(state.config.audit_log_path, entry)
        raise
    before, after = reload_diff.changes(previous, state.config)
    entry = audit.record("config.reload", actor, target, "applied", before=before, after=after, also=asdict(reloaded))
    audit.append_or_log(state.config.audit_log_path, entry)
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
        state = gateway_of(request)
        try:
            async with state.apply_lock:
                reloaded = reload_and_log(state, audit.admin_actor(request))
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
    state.spawn(_reload_on_signal(state))  # after any write applying now (``apply_lock``)


async def _reload_on_signal(state: GatewayState) -> None:
    async with state.apply_lock:
        with suppress(GatewayConfigError):  # logged; the running configuration stays
            reload_and_log(state, "signal:SIGHUP")


__all__ = ["APPLIED", "Reloaded", "apply_config", "install", "reload_and_log", "reload_config", "restore"]
