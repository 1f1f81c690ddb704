"""Reading a request body as JSON the way the gateway can forward it unchanged, or refusing it.

Refused: a key given twice in one object (RFC 8259 leaves its meaning open: the gateway and the upstream
could read different values), ``NaN`` and ``Infinity`` (not JSON), text that is not UTF-8 (lone
surrogates), nesting deeper than ``MAX_JSON_DEPTH`` (the upstream call re-encodes the body, and
Python's encoder recurses once per level), and numbers longer than ``NUMBER_LENGTH_MAX`` characters or
beyond a 64-bit float (no field of the API needs more; Python refuses integers of over 4,300 digits with a
message about something else, and a float that overflows would be sent on as infinity).
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_JSON_DEPTH = 64
NUMBER_LENGTH_MAX = 100  # characters of one number, sign, point and exponent included


class BodyError(ValueError):
    """The body cannot be forwarded; ``param`` is the dotted path at fault (None: the whole body)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class DuplicateKey(BodyError):
    """A key given twice in one object."""


class Unreadable:
    """Where a number of the body could not be read: ``decode`` leaves one in its place, ``unsendable``
    names its path (the parser does not know where it is)."""

    def __init__(self, problem: str) -> None:
        self.problem = problem


def decode(raw: bytes) -> dict[str, Any]:
    """``raw`` as a JSON object, an ``Unreadable`` in place of each number too long or out of range (call
    ``unsendable`` on it). Raises ``DuplicateKey``, or ``BodyError`` (not JSON, not an object)."""
    try:
        data = json.loads(
            raw, parse_constant=_reject_constant, parse_int=_integer, parse_float=_float, object_pairs_hook=_object_once
        )
    except DuplicateKey:
        raise
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, ValueError):
        raise BodyError("The body is not valid JSON (NaN, Infinity and deep nesting are refused).") from None
    if not isinstance(data, dict):
        raise BodyError("The body must be a JSON object.")
    return data


def unsendable(value: Any, path: str = "", depth: int = 0) -> tuple[str, str] | None:
    """The first value that cannot be forwarded as JSON, as ``(dotted path, problem)``: a non-finite
    number, an ``Unreadable`` one, text that is not UTF-8, or nesting deeper than ``MAX_JSON_DEPTH``."""
    if depth > MAX_JSON_DEPTH:
        return path, f"nested deeper than {MAX_JSON_DEPTH} levels"
    if isinstance(value, Unreadable):
        return path, value.problem
    if isinstance(value, float) and not math.isfinite(value):
        return path, "numbers must be finite"
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path, "text must be valid UTF-8 (no lone surrogates)"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = unsendable(key, path) or unsendable(item, f"{path}.{key}" if path else str(key), depth + 1)
            if found:
                return found
    if isinstance(value, list):
        for index, item in enumerate(value):
            found = unsendable(item, f"{path}.{index}", depth + 1)
            if found:
                return found
    return None


def _too_long(text: str) -> Unreadable | None:
    if len(text) <= NUMBER_LENGTH_MAX:
        return None
    return Unreadable(f"number too long ({len(text):,} characters; at most {NUMBER_LENGTH_MAX})")


def _integer(text: str) -> int | Unreadable:
    return _too_long(text) or int(text)


def _float(text: str) -> float | Unreadable:
    too_long = _too_long(text)
    if too_long is not None:
        return too_long
    value = float(text)
    return value if math.isfinite(value) else Unreadable("number out of range (beyond what a 64-bit float holds)")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _object_once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(f"{key}: given twice in one object (which one was meant?).", key)
        out[key] = value
    return out
