"""The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``.

``type`` is OpenAI's error class (``invalid_request_error``, ``authentication_error``,
``permission_error``, ``rate_limit_error``, ``server_error``); ``param`` names the field at fault (None when
no one field is); ``code`` is a stable machine-readable reason (``invalid_api_key``, ``queue_full``, ...).
"""

from __future__ import annotations

from typing import Any


def error_body(message: str, kind: str, param: str | None, code: str | None) -> dict[str, Any]:
    """The OpenAI-shaped error document."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
