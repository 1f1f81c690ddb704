"""The admin API's writes: keys and tenants changed over HTTP, in force at once, in the file, and audited.

An ``[admin]`` key only (401 without a key or with an unknown one, 403 with a tenant's key)::

    GET  /admin/keys                      every key: tenant, label, hash prefix, created, expires (never a key)
    POST /admin/keys                      {"tenant", "name"?, "expires_in_days"?} -> 201, the new key (once)
    POST /admin/keys/revoke               {"hash" (a prefix, 12+ hex digits) | "name"} -> the key removed
    POST /admin/keys/rotate               {"hash" | "name", "grace_hours"? (24)} -> the new key (once); the
                                          old one works ``grace_hours`` more (0: removed now)
    PUT  /admin/tenants/{tenant}          the tenant's whole quota table (``fairgate.ledger.config``'s
                                          ``TenantConfig``: tier, weight, priority, limits, model_class) ->
                                          200 (changed) or 201 (a new tenant), with the table before and after
    GET  /admin/audit?limit=100           the last records of the audit log (``fairgate.gateway.audit``)

The configuration file stays the one source of truth: a write edits it (``fairgate.gateway.config_edit``,
under the same lock as ``fairgate keys``) and the file as it will be is applied to the running gateway
before it is put in place (a rename) - so what the gateway refuses (a bad value, a priority move) never
reaches the file, a file that cannot be put in place puts the running configuration back, and a write also
applies any change made to the file by hand since the last reload, as a reload would (the audit record's
``also`` names them). Writes and reloads take turns (``GatewayState.apply_lock``). Every write, applied or
refused, is one audit record, and a write the audit log cannot take is not made (503
``audit_log_unavailable``). A key given where its hash or name belongs is refused, and never written. The
file and its folder must be writable by the gateway: where they are not (a Kubernetes ConfigMap), edit the
file and reload instead; the write is then refused with the reason (503). Errors: 400 ``invalid_request``
(the field at fault), 400 ``config_invalid`` (what the change would make of the file, or what a reload
cannot apply), 404 ``tenant_not_found`` / ``key_not_found``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import tomllib
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, TypeVar

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from fairgate import keyfile
from fairgate.gateway import audit, config_edit
from fairgate.gateway.config import GatewayConfig, GatewayConfigError
from fairgate.gateway.identity import require_admin
from fairgate.gateway.intake import lenient_request_id, read_body
from fairgate.gateway.outcomes import Outcome, Rejection
from fairgate.gateway.reload import apply_config, restore
from fairgate.gateway.state import GatewayState, gateway_dependency
from fairgate.ledger.config import TenantConfig

log = logging.getLogger("fairgate.gateway")
T = TypeVar("T")
BODY_BYTES_MAX = 64 * 1024
AUDIT_PAGE_MAX = 1000
Gateway = Annotated[GatewayState, Depends(gateway_dependency)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class NewKeyBody(_Body):
    tenant: str
    name: Annotated[str, Field(max_length=config_edit.KEY_NAME_MAX)] | None = None
    expires_in_days: Annotated[float, Field(gt=0, le=config_edit.EXPIRES_IN_DAYS_MAX)] | None = None


class KeyNameBody(_Body):
    hash: Annotated[str, Field(min_length=1, max_length=200)] | None = None
    name: Annotated[str, Field(min_length=1, max_length=config_edit.KEY_NAME_MAX)] | None = None


class RotateBody(KeyNameBody):
    grace_hours: Annotated[float, Field(ge=0, le=config_edit.GRACE_HOURS_MAX)] = 24.0


def _time(moment: datetime | None) -> str | None:
    return None if moment is None else config_edit.toml_time(moment)


def _key_document(new: config_edit.NewKey) -> dict[str, Any]:
    return {
        "object": "api_key",
        "key": new.key,
        "tenant": new.tenant,
        "name": new.name,
        "hash": new.hash[: audit.HASH_PREFIX_CHARS],
        "created": _time(new.created),
        "expires": _time(new.expires),
    }


def _ref(ref: config_edit.KeyRef) -> dict[str, Any]:
    return {"tenant": ref.tenant, "name": ref.name, "hash": ref.hash[: audit.HASH_PREFIX_CHARS]}


# The audit record's ``before`` and ``after`` from a write's result and the configuration before it, and the
# key hashes the write itself added or removed (not counted in ``also``).
Changed = Callable[[T, GatewayConfig], tuple[Any, Any, set[str]]]
HASH_PREFIX = re.compile(r"sha256\$[0-9a-f$]{12,200}(\.\.\.)?")


async def _write(
    request: Request,
    state: GatewayState,
    action: str,
    target: dict[str, Any],
    make_change: Callable[[], config_edit.Change[T]],
    changed: Changed[T] = lambda result, previous: (None, None, set()),
) -> T:
    """Make the change ``make_change()`` gives (a ``config_edit`` change) in the file and the running gateway
    (``_apply_edit``), audited either way (``changed``: the record's ``before`` and ``after`` from the result
    and the configuration that ran before). Raises ``Rejection``: what ``config_edit`` or ``apply_config``
    refuse; 503 when the audit log cannot be written (checked first: nothing is changed then)."""
    try:
        await asyncio.to_thread(audit.check_writable, state.config.audit_log_path)
    except OSError as exc:
        message = f"The audit log cannot be written ({exc}); nothing was changed."
        raise Rejection(Outcome.AUDIT_UNAVAILABLE, message) from None
    actor = audit.admin_actor(request)
    try:
        result, previous, applied = await _apply_edit(state, make_change)
    except (GatewayConfigError, ValueError, keyfile.KeyFileError, OSError, tomllib.TOMLDecodeError) as exc:
        _audit(state, audit.record(action, actor, target, "refused", error=str(exc)))
        raise _rejection(exc, target) from None
    before, after, touched = changed(result, previous)
    also = _also(previous, applied, target.get("tenant") if action == "tenant.put" else None, touched)
    _audit(state, audit.record(action, actor, target, "applied", before=before, after=after, also=also))
    return result


async def _apply_edit(
    state: GatewayState, make_change: Callable[[], config_edit.Change[T]]
) -> tuple[T, GatewayConfig, GatewayConfig]:
    """Under ``state.apply_lock`` (no reload in between) and the file's edit lock (no ``fairgate keys`` in
    between): the change staged beside the file (off the event loop), applied to the running gateway (on
    it), then the file put in place; a file that cannot be put in place puts the running configuration
    back. Returns the result, the configuration before and the one applied."""
    path = state.config.path
    # Shielded: a request cancelled half way (its client gone, a shutdown) must neither leave the file lock
    # taken by a thread it no longer waits for nor stop between applying the change and writing the file.
    with anyio.CancelScope(shield=True):
        done = await _apply_edit_locked(state, path, make_change)
    return done


async def _apply_edit_locked(
    state: GatewayState, path: Path, make_change: Callable[[], config_edit.Change[T]]
) -> tuple[T, GatewayConfig, GatewayConfig]:
    async with state.apply_lock:
        handle = await asyncio.to_thread(keyfile.lock, path)
        try:
            staged = await asyncio.to_thread(config_edit.stage, path, make_change())
            previous = state.config
            try:
                apply_config(state, staged.candidate)
            except BaseException:
                staged.file.discard()
                raise
            try:
                staged.file.commit()
            except OSError:
                restore(state, previous)
                raise
            return staged.result, previous, staged.candidate
        finally:
            keyfile.unlock(handle)


def _also(previous: GatewayConfig, applied: GatewayConfig, tenant: str | None, touched: set[str]) -> Any:
    """What else applying the file brought into force (``audit``'s ``also``): hand edits since the last
    reload - tenants changed other than ``tenant``, keys added or removed other than ``touched``."""
    old, new = previous.quotas_document.get("tenants", {}), applied.quotas_document.get("tenants", {})
    tenants = sorted(name for name in set(old) | set(new) if name != tenant and old.get(name) != new.get(name))
    old_keys, new_keys = {k.hash for k in previous.keys}, {k.hash for k in applied.keys}
    added, removed = len(new_keys - old_keys - touched), len(old_keys - new_keys - touched)
    if not tenants and not added and not removed:
        return None
    return {"tenants": tenants, "keys_added": added, "keys_removed": removed}


def _rejection(exc: Exception, target: dict[str, Any]) -> Rejection:
    message = str(exc)
    if "no [[key]] matches" in message:
        return Rejection(Outcome.KEY_NOT_FOUND, message, "name" if target.get("name") else "hash")
    if isinstance(exc, GatewayConfigError) and f"no tenant {target.get('tenant')!r}" in message:
        return Rejection(Outcome.TENANT_NOT_FOUND, message, "tenant")
    if isinstance(exc, OSError) and not isinstance(exc, keyfile.KeyFileError):
        return Rejection(Outcome.AUDIT_UNAVAILABLE, f"The configuration file cannot be written: {exc}")
    param = _param_of(message, target)
    if isinstance(exc, GatewayConfigError | tomllib.TOMLDecodeError | keyfile.KeyFileError):
        return Rejection(Outcome.CONFIG_INVALID, message.splitlines()[0] if message else type(exc).__name__, param)
    return Rejection(Outcome.INVALID_REQUEST, message, param or message.partition(":")[0].strip() or None)


def _param_of(message: str, target: dict[str, Any]) -> str | None:
    """The body field a refusal names: what follows ``quotas.tenants.<tenant>.`` in it, or ``tier``."""
    tenant = target.get("tenant")
    marker = f"quotas.tenants.{tenant}." if tenant else None
    if marker and marker in message:
        return message.split(marker, 1)[1].split(":", 1)[0] or None
    return "tier" if "unknown tier" in message else None


def _audit(state: GatewayState, entry: dict[str, Any]) -> None:
    audit.append_or_log(state.config.audit_log_path, entry)


def _answer(request: Request, document: dict[str, Any], status: int = 200) -> JSONResponse:
    headers = {"x-request-id": lenient_request_id(request), "cache-control": "no-store"}
    return JSONResponse(document, status_code=status, headers=headers)


def install(app: FastAPI) -> None:
    """Add the routes of this module's docstring to the gateway ``app``."""
    _install_keys(app)
    _install_tenants(app)


def _install_keys(app: FastAPI) -> None:
    admin = [Depends(require_admin)]

    @app.get("/admin/keys", dependencies=admin, tags=["admin"])
    async def list_keys(request: Request, state: Gateway) -> JSONResponse:
        now = state.clock.wall_s()
        data = [
            {
                "tenant": key.tenant,
                "name": key.name,
                "hash": key.hash[: audit.HASH_PREFIX_CHARS],
                "created": _time(key.created),
                "expires": _time(key.expires),
                "expired": key.expires is not None and key.expires.timestamp() <= now,
            }
            for key in state.config.keys
        ]
        return _answer(request, {"object": "list", "data": data})

    @app.post("/admin/keys", dependencies=admin, tags=["admin"])
    async def add_key(request: Request, state: Gateway) -> JSONResponse:
        body = await read_body(request, NewKeyBody, BODY_BYTES_MAX)
        _no_key_in_label(body.name, state)
        path = state.config.path  # the tenant is looked up in the file: one added by hand is found there
        target = {"tenant": body.tenant, "name": body.name}
        new = await _write(
            request,
            state,
            "key.add",
            target,
            lambda: config_edit.key_added(path, body.tenant, body.name, body.expires_in_days),
            lambda new, _: (None, {**_key_document(new), "key": None}, {new.hash}),
        )
        return _answer(request, _key_document(new), 201)

    @app.post("/admin/keys/revoke", dependencies=admin, tags=["admin"])
    async def revoke_key(request: Request, state: Gateway) -> JSONResponse:
        body = _one_key(await read_body(request, KeyNameBody, BODY_BYTES_MAX), state)
        path = state.config.path
        gone = await _write(
            request,
            state,
            "key.revoke",
            {"hash": body.hash, "name": body.name},
            lambda: config_edit.key_revoked(path, body.hash, body.name),
            lambda gone, _: (_ref(gone), None, {gone.hash}),
        )
        return _answer(request, {"object": "api_key", "revoked": True, **_ref(gone)})

    @app.post("/admin/keys/rotate", dependencies=admin, tags=["admin"])
    async def rotate_key(request: Request, state: Gateway) -> JSONResponse:
        body = _one_key(await read_body(request, RotateBody, BODY_BYTES_MAX), state)
        path = state.config.path
        new, old, ends = await _write(
            request,
            state,
            "key.rotate",
            {"hash": body.hash, "name": body.name, "grace_hours": body.grace_hours},
            lambda: config_edit.key_rotated(path, body.hash, body.name, body.grace_hours),
            lambda rotated, _: (
                _ref(rotated[1]),
                {**_key_document(rotated[0]), "key": None},
                {r.hash for r in rotated[:2]},
            ),
        )
        replaced = {**_ref(old), "expires": _time(ends), "removed": ends is None}  # None: gone now, not "never"
        return _answer(request, {**_key_document(new), "replaces": replaced})


def _no_key_in_label(label: str | None, state: GatewayState) -> None:
    """Refuse a key's label that holds a key this gateway knows, alone or among other words (``Bearer sk-...``,
    ``my key is sk-...``): a label is written to the file, the audit log and ``GET /admin/keys`` in clear."""
    words = (label or "").replace('"', " ").replace("'", " ").replace(",", " ").split()
    if any(state.identity.is_key(word) for word in words):
        raise Rejection(
            Outcome.INVALID_REQUEST, "name: it holds an API key; a key's name is a label, written in clear.", "name"
        )


def _one_key(body: T, state: GatewayState) -> T:
    """``body`` (a ``KeyNameBody``) naming one key by a hash prefix or a name, neither of them a key itself
    (refused before anything is written: a key pasted here must not reach the audit log)."""
    assert isinstance(body, KeyNameBody)
    if (body.hash is None) == (body.name is None):
        raise Rejection(
            Outcome.INVALID_REQUEST, "Name the key by its hash prefix or by its name (one of them).", "hash"
        )
    for field, value in (("hash", body.hash), ("name", body.name)):
        if value is not None and state.identity.is_key(value):
            raise Rejection(
                Outcome.INVALID_REQUEST,
                f"{field}: that is an API key, not a key's {field}; name it by the hash GET /admin/keys shows.",
                field,
            )
    if body.hash is not None and not HASH_PREFIX.fullmatch(body.hash):
        raise Rejection(Outcome.INVALID_REQUEST, "hash: a key's stored hash, or its first 19+ characters.", "hash")
    return body


def _install_tenants(app: FastAPI) -> None:
    admin = [Depends(require_admin)]

    @app.put("/admin/tenants/{tenant}", dependencies=admin, tags=["admin"])
    async def put_tenant(tenant: str, request: Request, state: Gateway) -> JSONResponse:
        body = await read_body(request, TenantConfig, BODY_BYTES_MAX)
        table = body.model_dump(exclude_unset=True, exclude_none=True)
        path = state.config.path
        before, after = await _write(
            request,
            state,
            "tenant.put",
            {"tenant": tenant},
            lambda: config_edit.tenant_put(path, tenant, table),
            lambda tables, previous: (previous.quotas_document.get("tenants", {}).get(tenant), tables[1], set()),
        )
        document = {"object": "tenant", "tenant": tenant, "created": before is None, "before": before, "after": after}
        return _answer(request, document, 201 if before is None else 200)

    @app.get("/admin/audit", dependencies=admin, tags=["admin"])
    async def audit_records(request: Request, state: Gateway) -> JSONResponse:
        limit_text = request.query_params.get("limit", "100")
        if not re.fullmatch(r"[0-9]{1,4}", limit_text) or not 1 <= int(limit_text) <= AUDIT_PAGE_MAX:
            raise Rejection(Outcome.INVALID_REQUEST, f"limit must be a whole number in [1, {AUDIT_PAGE_MAX}].", "limit")
        try:
            records = await asyncio.to_thread(audit.read, state.config.audit_log_path)
        except (OSError, ValueError) as exc:
            message = f"{state.config.audit_log_path}: cannot be read: {exc}"
            raise Rejection(Outcome.AUDIT_UNAVAILABLE, message) from None
        return _answer(request, {"object": "list", "data": records[-int(limit_text) :]})


__all__ = ["install"]
