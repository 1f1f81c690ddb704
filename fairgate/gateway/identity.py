"""Who is calling, and for which tenant: the credential checks, and the FastAPI dependencies that run them.

The tenant of a request always comes from its credential (``Authorization: Bearer <key>``), never from its
body or headers (seed 003, "identity"). A delegate service (itself a tenant, listed in ``[delegation]``)
acting for another tenant adds a signed, expiring ``X-Fairgate-On-Behalf-Of`` token
(``fairgate.gateway.auth``); the request is then billed to that tenant and the delegate recorded.

Routes declare what they need: ``require_tenant`` (a tenant's key, or a delegate's with its token),
``require_admin`` (an ``[admin]`` key) or ``admin_or_tenant`` (the dashboard: either). Each raises a
``Rejection`` (401 no or unknown key, 403 not allowed, 400 a header given twice).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from fairgate.gateway.auth import DelegationError, KeyRing, verify_on_behalf_of
from fairgate.gateway.config import GatewayConfig
from fairgate.gateway.outcomes import Outcome, Rejection

ON_BEHALF_OF_HEADER = "x-fairgate-on-behalf-of"
ADMIN = "admin"  # the name admin keys map to in their key ring
KEY_ID_CHARS = 19  # "sha256$" and 12 hex digits: a prefix of the hash `fairgate keys list` shows
# OpenAPI only: declares the bearer key (auto_error=False: the checks below answer, OpenAI-shaped).
BEARER = HTTPBearer(auto_error=False, scheme_name="apiKey", description="Authorization: Bearer <tenant key>")


@dataclass(frozen=True)
class Caller:
    """An authenticated request's tenant (billed), the delegate acting for it, if any, and ``key_id``: the
    first ``KEY_ID_CHARS`` characters of the stored hash of the key it came with (the delegate's, for a
    delegated call; None: not known), the dimension usage is told apart by inside a tenant."""

    tenant: str
    delegate: str | None = None
    key_id: str | None = None


class Identity:
    """The gateway's API keys, admin keys and delegation settings.

    Args:
        config: the gateway configuration (keys hashed, delegation secret from the environment).
        wall_s: seconds since the epoch (on-behalf-of token expiry).
    """

    def __init__(self, config: GatewayConfig, wall_s: Callable[[], float]) -> None:
        self._config = config
        self._wall_s = wall_s
        self._admin_keys = KeyRing((ADMIN, stored) for stored in config.admin.key_hashes)
        self._ring_keys()

    def _ring_keys(self) -> None:
        """Split the ``[[key]]`` tables into the keys that work now and those expired (kept apart to say so),
        and note when the next one expires (the rings are made again then)."""
        now_s = self._wall_s()
        live: list[tuple[str, str]] = []
        expired: list[tuple[str, str]] = []
        later = [math.inf]
        for key in self._config.keys:
            expires_s = key.expires_s
            # Filed under the stored hash itself: a match names the key (its id), and through it the tenant.
            (expired if expires_s is not None and expires_s <= now_s else live).append((key.hash, key.hash))
            if expires_s is not None and expires_s > now_s:
                later.append(expires_s)
        self._keys, self._expired_keys, self._next_expiry_s = KeyRing(live), KeyRing(expired), min(later)
        self._tenant_of_hash = {key.hash: key.tenant for key in self._config.keys}

    @property
    def keys(self) -> int:
        """How many tenant keys work now."""
        return len(self._keys)

    def tenant_of(self, request: Request) -> Caller:
        """The caller of a tenant route. Raises ``Rejection`` 400/401/403."""
        if len(request.headers.getlist("authorization")) > 1:
            raise Rejection(Outcome.AUTH_HEADER_REPEATED, "Send one Authorization header.", "authorization")
        key = _bearer_key(request)
        if key is None:
            raise Rejection(Outcome.API_KEY_MISSING, "Missing API key: send Authorization: Bearer <key>.")
        caller, key_id = self._owner_of(key)
        if caller is None:
            if self._expired_keys.owners_for(key):
                raise Rejection(Outcome.API_KEY_EXPIRED, "This API key has expired; ask for a new one.")
            if self._admin_keys.tenant_for(key) == ADMIN:  # the caller holds it: saying so tells them nothing new
                raise Rejection(Outcome.API_KEY_INVALID, "This is an admin key; this route takes a tenant's key.")
            raise Rejection(Outcome.API_KEY_INVALID, "Invalid API key.")
        tokens = request.headers.getlist(ON_BEHALF_OF_HEADER)
        if len(tokens) > 1:
            raise Rejection(
                Outcome.DELEGATION_HEADER_REPEATED,
                "Send one X-Fairgate-On-Behalf-Of header.",
                ON_BEHALF_OF_HEADER,
                tenant=caller,
            )
        if not tokens:
            return Caller(caller, None, key_id)
        return Caller(self._delegated(caller, tokens[0]), caller, key_id)

    def _owner_of(self, key: str) -> tuple[str | None, str | None]:
        """The tenant of ``key`` and its id (``Caller.key_id``); ``(None, None)`` for an unknown key, or one
        whose stored hashes name two tenants (an operator's mistake: refused)."""
        if self._wall_s() >= self._next_expiry_s:
            self._ring_keys()
        hashes = self._keys.owners_for(key)
        tenants = {self._tenant_of_hash[stored] for stored in hashes}
        if len(tenants) != 1:
            return None, None
        return tenants.pop(), min(hashes)[:KEY_ID_CHARS]

    def is_key(self, text: str) -> bool:
        """Whether ``text`` is a key this gateway knows (a tenant's, expired or not, or an admin's): what must
        never be written anywhere (an admin pasting a leaked key where its hash belongs)."""
        return bool(self._keys.owners_for(text) or self._expired_keys.owners_for(text)) or bool(
            self._admin_keys.owners_for(text)
        )

    def _tenant_for(self, key: str) -> str | None:
        return self._owner_of(key)[0]

    def _delegated(self, caller: str, token: str) -> str:
        """The tenant ``caller`` acts for with ``token``. Raises ``Rejection`` 403."""

        def refuse(outcome: Outcome, message: str) -> Rejection:
            return Rejection(outcome, message, tenant=caller)

        if caller not in self._config.delegation.delegates:
            raise refuse(Outcome.DELEGATION_NOT_ALLOWED, f"Tenant {caller!r} may not act on behalf of others.")
        secret = self._config.delegation_secret()
        if secret is None:
            raise refuse(Outcome.DELEGATION_NOT_ALLOWED, "Delegation is not configured on this gateway.")
        try:
            lifetime_max_s = self._config.gateway.delegation_token_lifetime_max_s
            tenant = verify_on_behalf_of(secret, token, caller, self._wall_s(), lifetime_max_s)
        except DelegationError as exc:
            raise refuse(Outcome.DELEGATION_INVALID, f"On-behalf-of token rejected: {exc}") from None
        if tenant not in self._config.quotas.tenants:
            raise refuse(Outcome.DELEGATION_INVALID, "The on-behalf-of token names an unknown tenant.")
        return tenant

    def check_admin(self, request: Request) -> None:
        """Accept only an ``[admin]`` key. Raises ``Rejection`` 401 (no or unknown key), 403 (a tenant's key)."""
        key = _bearer_key(request)
        if key is None:
            raise Rejection(Outcome.API_KEY_MISSING, "Missing API key: send Authorization: Bearer <admin key>.")
        if self._admin_keys.tenant_for(key) == ADMIN:
            return
        if self._tenant_for(key) is not None:
            raise Rejection(Outcome.ADMIN_ONLY, "This endpoint needs an admin key.")
        raise Rejection(Outcome.API_KEY_INVALID, "Invalid API key.")

    def is_admin(self, request: Request) -> bool:
        """Whether the request carries an ``[admin]`` key."""
        key = _bearer_key(request)
        return key is not None and self._admin_keys.tenant_for(key) == ADMIN


def _bearer_key(request: Request) -> str | None:
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else None


def _identity(request: Request) -> Identity:
    identity = request.state.gateway.identity  # the gateway's state, from the app's lifespan
    assert isinstance(identity, Identity)
    return identity


Bearer = Annotated[HTTPAuthorizationCredentials | None, Security(BEARER)]

# The dependencies are ``async``: FastAPI runs a plain ``def`` dependency on its thread pool, and their work (a
# SHA-256 and a dictionary probe) is less than the thread hop it would cost each request.


async def require_tenant(request: Request, _: Bearer) -> Caller:
    """FastAPI dependency: the request's ``Caller`` (a tenant's key). Raises ``Rejection``."""
    return _identity(request).tenant_of(request)


async def require_admin(request: Request, _: Bearer) -> None:
    """FastAPI dependency: an ``[admin]`` key, or a ``Rejection``."""
    _identity(request).check_admin(request)


async def admin_or_tenant(request: Request, _: Bearer) -> Caller | None:
    """FastAPI dependency: None for an admin key, else the tenant's ``Caller``. Raises ``Rejection``."""
    identity = _identity(request)
    return None if identity.is_admin(request) else identity.tenant_of(request)
