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
    # An integer literal too large for a float would overflow `math.isfinite`: compare it as is.
    if not is_number(value) or (isinstance(value, float) and not math.isfinite(value)) \
            or not low <= value <= high:
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


def check_logit_bias(body: dict[str, Any], vocab_size: int, max_bias: float = 100.0) -> None:
    """OpenAI's shape (token id strings -> a bias in [-100, 100]), ids inside the vocabulary;
    then a non-empty map is refused: this server's sampling applies no biases."""
    value = body.get("logit_bias")
    if value is None:
        return
    if not isinstance(value, dict):
        raise invalid(f"`logit_bias` must be an object mapping token ids to biases, got "
                      f"{show(value)}", "logit_bias")
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < vocab_size):
            raise invalid(f"`logit_bias` key {show(key)} is not a token id inside the vocabulary "
                          f"[0, {vocab_size})", "logit_bias")
        if not is_number(bias) or (isinstance(bias, float) and not math.isfinite(bias)) \
                or not -max_bias <= bias <= max_bias:
            raise invalid(f"`logit_bias` values must be numbers from {-max_bias:g} to "
                          f"{max_bias:g}, got {show(bias)} for token {key}", "logit_bias")
    if value:
        raise invalid("`logit_bias` is not supported by this server; send {} or null",
                      "logit_bias", code="unsupported_parameter")
