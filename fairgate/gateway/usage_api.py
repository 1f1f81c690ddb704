"""Scoped usage APIs: /v1/usage for a tenant, /admin/... for operators (issue 5, part 2)."""

from __future__ import annotations

from fastapi import FastAPI


def install(app: FastAPI) -> None:
    """Add this view's observer and routes to the gateway ``app`` (not yet built)."""
