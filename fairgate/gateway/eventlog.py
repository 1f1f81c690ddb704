"""Structured request log, JSON lines (issue 5, part 5)."""

from __future__ import annotations

from fastapi import FastAPI


def install(app: FastAPI) -> None:
    """Add this view's observer and routes to the gateway ``app`` (not yet built)."""
