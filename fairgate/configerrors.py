"""One-line messages for invalid configuration files (scenarios, gateway configs), from pydantic errors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

# A value that fails a union fails every alternative; the complaints about the wrong *kind* of value (a
# table where a number was, or the reverse) are noise beside the one about its content.
KIND_ERRORS = {"int_type", "int_parsing", "float_type", "model_attributes_type", "dict_type", "model_type"}
_UNION_TAGS = ("int", "float", "fixed", "lognormal", "empirical")


def format_location(location: tuple[Any, ...]) -> str:
    """``("tenant", 3, "output", "mean")`` -> ``tenant[3].output.mean``; pydantic's union and validator
    tags are left out."""
    out = ""
    for part in location:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _UNION_TAGS or str(part).startswith(("tagged-union", "constrained-", "function-")):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def pydantic_message(
    path: Path | str, error: ValidationError, pattern_message: Callable[[str], str] | None = None
) -> str:
    """``<path>: <dotted.key>: <problem>``: a misspelt key first (it also leaves its real name missing),
    else the deepest problem; how many more there are.

    Args:
        pattern_message: location -> what a value failing its pattern must look like.
    """
    errors = error.errors()
    telling = [e for e in errors if e["type"] not in KIND_ERRORS] or errors
    unknown = [e for e in telling if e["type"] == "extra_forbidden"]
    first = unknown[0] if unknown else max(telling, key=lambda e: len(format_location(tuple(e["loc"]))))
    location = format_location(tuple(first["loc"]))
    message = first["msg"].replace(" or instance of _Empty", "").replace("Value error, ", "")
    if location == "(top level)" and first["type"] == "value_error":
        return f"{path}: {message}"  # a whole-document check names its own keys
    if first["type"] == "extra_forbidden":
        message = "unknown key"
    elif first["type"] == "missing":
        message = "missing required key"
    elif first["type"] == "string_pattern_mismatch" and pattern_message is not None:
        message = pattern_message(location)
    more = len(telling) - 1
    extra = f" (and {more} more problem{'s' if more > 1 else ''} after fixing this)" if more else ""
    return f"{path}: {location}: {message}{extra}"
