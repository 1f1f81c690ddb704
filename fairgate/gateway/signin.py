"""Sign-in links for the dashboard: a short-lived signed token in a link, never a key in a URL.

``POST /admin/dashboard-links`` (admin key) with ``{"tenant": NAME}`` (that tenant's view) or
``{"tenant": null}`` (the administrator's view), and ``ttl_s`` (``LINK_TTL_S_MIN`` to ``LINK_TTL_S_MAX``,
default ``LINK_TTL_S_DEFAULT``) answers ``{"url": "/dashboard#signin=<token>", "expires_at_s": ...}``.

The token sits in the URL's fragment: a browser sends no fragment to the server, so it is in no access
log, proxy log or ``Referer``. The page takes it from the fragment, removes it from the address bar, keeps
it in the tab's ``sessionStorage`` and sends it as ``Authorization: Bearer fgdash_<token>`` to
``/dashboard/data`` only: no other route takes it. Each poll verifies it again: expired, it is a 401 (sign
in again); a tenant no longer configured, a 401 too.

Format: ``base64url(payload) + "." + base64url(HMAC-SHA256(secret, "fairgate-dashboard-link:" + payload))``,
payload ``{"exp": expiry s, "t": tenant or "", "v": 1}``; the prefix keeps a link's signature from ever
passing as an on-behalf-of token's, which is signed with the same secret (``fairgate.gateway.auth``).
The secret is the delegation secret when configured (every process that shares it takes the link),
else a random one per process (the link works on the process that made it, until it restarts). A link
cannot be revoked before it expires, short of a new secret (which voids every link and on-behalf-of token):
making one is recorded in the audit log (``dashboard_link.make``: who, which view, until when).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import secrets
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from fairgate.gateway import audit
from fairgate.gateway.identity import Bearer, Caller, admin_or_tenant, require_admin
from fairgate.gateway.intake import read_body
from fairgate.gateway.outcomes import Outcome, Rejection
from fairgate.gateway.state import GatewayState, gateway_of

PREFIX = "fgdash_"
LINK_TTL_S_MIN = 60.0
LINK_TTL_S_MAX = 86_400.0
LINK_TTL_S_DEFAULT = 900.0
TOKEN_LENGTH_MAX = 1024
_DOMAIN = b"fairgate-dashboard-link:"
_VERSION = 1
_PROCESS_SECRET = secrets.token_bytes(32)


class LinkBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    tenant: Annotated[str, Field(min_length=1, max_length=200)] | None
    ttl_s: Annotated[float, Field(ge=LINK_TTL_S_MIN, le=LINK_TTL_S_MAX)] = LINK_TTL_S_DEFAULT


@dataclass(frozen=True)
class Link:
    """What a verified token grants: ``tenant``'s view (None: the administrator's) until ``expires_at_s``."""

    tenant: str | None
    expires_at_s: float


def secret_of(state: GatewayState) -> bytes:
    """The signing secret (module docstring). Raises ``GatewayConfigError`` (a delegation secret too short)."""
    return state.config.delegation_secret() or _PROCESS_SECRET


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    if not text or any(c not in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_" for c in text):
        raise ValueError("not base64url")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _sign(secret: bytes, payload: str) -> bytes:
    return hmac.new(secret, _DOMAIN + payload.encode("ascii"), hashlib.sha256).digest()


def make_token(secret: bytes, tenant: str | None, expires_at_s: float) -> str:
    """A link token for ``tenant``'s view (None: the administrator's) until ``expires_at_s`` (module docstring).
    Raises ``ValueError``: a non-finite expiry."""
    if not math.isfinite(expires_at_s):
        raise ValueError("expires_at_s must be finite")
    document = {"exp": expires_at_s, "t": tenant or "", "v": _VERSION}
    payload = _b64(json.dumps(document, separators=(",", ":"), sort_keys=True).encode("utf-8"))
    return f"{payload}.{_b64(_sign(secret, payload))}"


def verify_token(secret: bytes, token: str, now_s: float) -> Link:
    """What ``token`` grants at ``now_s``. Raises ``ValueError`` saying why it is refused (malformed, a bad
    signature, expired, or an expiry further than ``LINK_TTL_S_MAX`` ahead)."""
    if len(token) > TOKEN_LENGTH_MAX or token.count(".") != 1:
        raise ValueError("malformed")
    payload, signature = token.split(".")
    try:
        if not hmac.compare_digest(_unb64(signature), _sign(secret, payload)):
            raise ValueError("bad signature")
        document = json.loads(_unb64(payload))
    except (binascii.Error, UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("malformed") from None
    expires = document.get("exp") if isinstance(document, dict) else None
    tenant = document.get("t") if isinstance(document, dict) else None
    if document.get("v") != _VERSION or not isinstance(expires, int | float) or not isinstance(tenant, str):
        raise ValueError("malformed")
    if now_s >= expires:
        raise ValueError("expired")
    if expires - now_s > LINK_TTL_S_MAX:
        raise ValueError("expires too far ahead")
    return Link(tenant or None, float(expires))


async def dashboard_caller(request: Request, bearer: Bearer) -> Caller | None:
    """FastAPI dependency of ``/dashboard/data``: a link token's view (None: the administrator's), else
    ``admin_or_tenant``'s. Raises ``Rejection`` 401 for a token refused."""
    key = request.headers.get("authorization", "").partition(" ")[2].strip()
    if not key.startswith(PREFIX):
        return await admin_or_tenant(request, bearer)
    state = gateway_of(request)
    try:
        link = verify_token(secret_of(state), key.removeprefix(PREFIX), state.clock.wall_s())
    except ValueError as exc:
        raise Rejection(
            Outcome.API_KEY_INVALID, f"This sign-in link is not valid ({exc}); ask for a new one."
        ) from None
    if link.tenant is None:
        return None
    if link.tenant not in state.config.quotas.tenants:
        raise Rejection(Outcome.API_KEY_INVALID, "This sign-in link's tenant is not configured; ask for a new one.")
    return Caller(link.tenant)


DashboardCaller = Annotated[Caller | None, Depends(dashboard_caller)]


def install(app: FastAPI) -> None:
    """Add ``POST /admin/dashboard-links`` to the gateway ``app``."""

    @app.post("/admin/dashboard-links", dependencies=[Depends(require_admin)], tags=["admin"])
    async def make_link(request: Request) -> JSONResponse:
        state = gateway_of(request)
        body = await read_body(request, LinkBody, 4096)
        if body.tenant is not None and body.tenant not in state.config.quotas.tenants:
            raise Rejection(Outcome.TENANT_NOT_FOUND, f"No tenant {body.tenant!r} is configured.", "tenant")
        expires = state.clock.wall_s() + body.ttl_s
        token = make_token(secret_of(state), body.tenant, expires)
        # A link cannot be taken back before it expires (only a new delegation secret voids every link), so who
        # made one, for which view and until when, is on record (never the token).
        target = {"tenant": body.tenant, "expires_at_s": round(expires, 3)}
        entry = audit.record("dashboard_link.make", audit.admin_actor(request), target, "applied")
        audit.append_or_log(state.config.audit_log_path, entry)
        document: dict[str, Any] = {
            "object": "dashboard_link",
            "url": f"/dashboard#signin={PREFIX}{token}",
            "tenant": body.tenant,
            "expires_at_s": round(expires, 3),
        }
        return JSONResponse(document, status_code=201, headers={"cache-control": "no-store"})


__all__ = ["PREFIX", "DashboardCaller", "Link", "install", "make_token", "verify_token"]
