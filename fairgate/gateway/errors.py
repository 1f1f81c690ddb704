"""Errors answered to clients: OpenAI-shaped bodies (``{"error": {message, type, param, code}}``) with
``x-request-id``, and ``Retry-After`` in whole seconds with up to +25 % jitter (seed 003: rejected clients
must not come back as one wave)."""

from __future__ import annotations

import math
import random

from fastapi.responses import JSONResponse


class GatewayError(Exception):
    """An error answered to the client: HTTP status, OpenAI error ``type`` and ``code``, the field at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        retry_after_s: float | None = None,
        reason: str | None = None,
        dimension: str | None = None,
        headers: dict[str, str] | None = None,
        after_admission: bool = False,
        caller: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.kind = status, message, code, param, kind
        self.retry_after_s = retry_after_s
        self.reason = reason or _default_reason(status)
        self.dimension = dimension
        self.headers = headers or {}
        self.after_admission = after_admission  # the request had a reservation (now released)
        self.caller = caller  # the tenant whose key made a refused request (a delegation refused), if known


def _default_reason(status: int) -> str:
    """The rejection reason (``observe.REJECT_REASONS``) of an error without a more specific one."""
    if status in (401, 403):
        return "auth"
    if status == 409:
        return "conflict"
    if status >= 500:
        return "upstream_error"
    return "invalid"


def error_response(error: GatewayError, request_id: str) -> JSONResponse:
    """The client's answer to ``error``: its status, the OpenAI error body, ``x-request-id``, ``Retry-After``."""
    headers = {"x-request-id": request_id, **error.headers}
    if error.status in (400, 401, 403, 404, 409, 413):
        headers["x-should-retry"] = "false"  # the same request would get the same answer (OpenAI SDKs obey)
    if error.retry_after_s is not None:
        # Jitter (up to +25 %) so rejected clients do not come back as one wave (seed 003).
        headers["retry-after"] = str(max(1, math.ceil(error.retry_after_s * (1 + 0.25 * random.random()))))
    body = {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.code}}
    return JSONResponse(status_code=error.status, content=body, headers=headers)
