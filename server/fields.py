"""Typed readers for JSON request fields: each returns the value or raises a 400 naming the field.

JSON has no integer/boolean distinction that Python keeps (`True` is an `int`), and `1e400`
parses as infinity, so every reader checks the exact type and finiteness itself.
"""

from __future__ import annotations

import json
import math
from typing import Any

from server.errors import invalid


def show(value: Any, limit: int = 40) -> str:
    """A short JSON-ish rendering of a client's value for an error message."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def get_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"`{name}` must be true or false, got {show(value)}", name)
    return value


def get_int(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    """The integer at `name` within [low, high], or None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value) or not low <= value <= high:
        raise invalid(f"`{name}` must be an integer from {low} to {high}, got {show(value)}", name)
    return int(value)


def get_float(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    """The finite number at `name` within [low, high], or None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    if not is_number(value) or not math.isfinite(value) or not low <= value <= high:
        raise invalid(f"`{name}` must be a number from {low} to {high}, got {show(value)}", name)
    return float(value)


def get_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise invalid(f"`{name}` must be a string, got {show(value)}", name)
    return value


def require_unsupported_default(body: dict[str, Any], name: str, allowed: tuple[Any, ...]) -> None:
    """Accept a field this server does not implement only at its no-op value(s)."""
    value = body.get(name)
    if value is None:
        return
    if any(type(value) is type(ok) and value == ok for ok in allowed):
        return
    accepted = "".join(f"{show(ok)} or " for ok in allowed) + "null"
    raise invalid(f"`{name}` is not supported by this server; send {accepted}", name,
                  code="unsupported_parameter")
