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
under the same lock as ``fairgate keys``), and the file as it will be is applied to the running gateway
(``fairgate.gateway.reload.apply_config``) before it is written - so what the gateway refuses (a bad value,
a priority move) never reaches the file, and a write also applies any change made to the file by hand since
the last reload, as a reload would. Every write, applied or refused, is one audit record. The file must be
writable by the gateway: where it is not (a Kubernetes ConfigMap), edit it and reload instead; the write
is then refused with the reason. Errors: 400 ``invalid_request`` (the field at fault), 400
``config_invalid`` (what the change would make of the file, or what a reload cannot apply), 404
``tenant_not_found`` / ``key_not_found``.
"""

from __future__ import annotations

import asyncio
import logging
import tomllib
from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from fairgate import keyfile
from fairgate.gateway import audit, config_edit
from fairgate.gateway.config import GatewayConfig, GatewayConfigError
from fairgate.gateway.identity import require_admin
from fairgate.gateway.intake import lenient_request_id, read_body
from fairgate.gateway.outcomes import Outcome, Rejection
from fairgate.gateway.reload import apply_config
from fairgate.gateway.state import GatewayState, gateway_of
from fairgate.ledger.config import TenantConfig

log = logging.getLogger("fairgate.gateway")
T = TypeVar("T")
BODY_BYTES_MAX = 64 * 1024
AUDIT_PAGE_MAX = 1000
Gateway = Annotated[GatewayState, Depends(gateway_of)]


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


async def _write(
    request: Request,
    state: GatewayState,
    action: str,
    target: dict[str, Any],
    change: Callable[[config_edit.Apply], T],
    changed: Callable[[T], tuple[Any, Any]] = lambda result: (None, None),
) -> T:
    """Run ``change`` (a ``config_edit`` call given the apply step) off the event loop, audited either way
    (``changed``: the record's ``before`` and ``after`` from the result). Raises ``Rejection`` for what
    ``config_edit`` or ``apply_config`` refuse."""

    def apply(candidate: GatewayConfig) -> None:
        apply_config(state, candidate)

    actor = audit.admin_actor(request)
    try:
        result = await asyncio.to_thread(change, apply)
    except (GatewayConfigError, ValueError, keyfile.KeyFileError, OSError, tomllib.TOMLDecodeError) as exc:
        rejection = _rejection(exc)
        _audit(state, audit.record(action, actor, target, "refused", error=str(exc)))
        raise rejection from None
    before, after = changed(result)
    _audit(state, audit.record(action, actor, target, "applied", before=before, after=after))
    return result


def _rejection(exc: Exception) -> Rejection:
    message = str(exc)
    if "no [[key]] matches" in message:
        return Rejection(Outcome.KEY_NOT_FOUND, message, "hash")
    if isinstance(exc, GatewayConfigError | tomllib.TOMLDecodeError | keyfile.KeyFileError | OSError):
        return Rejection(Outcome.CONFIG_INVALID, message.splitlines()[0] if message else type(exc).__name__)
    return Rejection(Outcome.INVALID_REQUEST, message)


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
        if body.tenant not in state.config.quotas.tenants:
            raise Rejection(Outcome.TENANT_NOT_FOUND, f"No tenant {body.tenant!r} is configured.", "tenant")
        path = state.config.path
        target = {"tenant": body.tenant, "name": body.name}
        new = await _write(
            request,
            state,
            "key.add",
            target,
            lambda apply: config_edit.add_key(path, body.tenant, body.name, body.expires_in_days, apply),
            lambda new: (None, {**_key_document(new), "key": None}),
        )
        return _answer(request, _key_document(new), 201)

    @app.post("/admin/keys/revoke", dependencies=admin, tags=["admin"])
    async def revoke_key(request: Request, state: Gateway) -> JSONResponse:
        body = _one_key(await read_body(request, KeyNameBody, BODY_BYTES_MAX))
        path = state.config.path
        gone = await _write(
            request,
            state,
            "key.revoke",
            {"hash": body.hash, "name": body.name},
            lambda apply: config_edit.revoke_key(path, body.hash, body.name, apply),
            lambda gone: (_ref(gone), None),
        )
        return _answer(request, {"object": "api_key", "revoked": True, **_ref(gone)})

    @app.post("/admin/keys/rotate", dependencies=admin, tags=["admin"])
    async def rotate_key(request: Request, state: Gateway) -> JSONResponse:
        body = _one_key(await read_body(request, RotateBody, BODY_BYTES_MAX))
        path = state.config.path
        new, old, ends = await _write(
            request,
            state,
            "key.rotate",
            {"hash": body.hash, "name": body.name, "grace_hours": body.grace_hours},
            lambda apply: config_edit.rotate_key(path, body.hash, body.name, body.grace_hours, apply),
            lambda rotated: (_ref(rotated[1]), {**_key_document(rotated[0]), "key": None}),
        )
        return _answer(request, {**_key_document(new), "replaces": {**_ref(old), "expires": _time(ends)}})


def _one_key(body: T) -> T:
    assert isinstance(body, KeyNameBody)
    if (body.hash is None) == (body.name is None):
        raise Rejection(
            Outcome.INVALID_REQUEST, "Name the key by its hash prefix or by its name (one of them).", "hash"
        )
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
            lambda apply: config_edit.put_tenant(path, tenant, table, apply),
            lambda tables: tables,
        )
        document = {"object": "tenant", "tenant": tenant, "created": before is None, "before": before, "after": after}
        return _answer(request, document, 201 if before is None else 200)

    @app.get("/admin/audit", dependencies=admin, tags=["admin"])
    async def audit_records(request: Request, state: Gateway) -> JSONResponse:
        limit_text = request.query_params.get("limit", "100")
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= AUDIT_PAGE_MAX:
            raise Rejection(Outcome.INVALID_REQUEST, f"limit must be a whole number in [1, {AUDIT_PAGE_MAX}].", "limit")
        try:
            records = await asyncio.to_thread(audit.read, state.config.audit_log_path)
        except (OSError, ValueError) as exc:
            raise Rejection(Outcome.CONFIG_INVALID, f"{state.config.audit_log_path}: cannot be read: {exc}") from None
        return _answer(request, {"object": "list", "data": records[-int(limit_text) :]})


__all__ = ["install"]
