"""What a grammar is compiled from, importable without MLX or llguidance (the HTTP layer reads
requests into these; runtime/grammar.py compiles them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

# No free whitespace (a model may spend every token on it), OpenAI's and json.dumps' separators.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

FormatKind = Literal["json_object", "json_schema"]


class GrammarError(ValueError):
    """A schema or grammar the grammar engine cannot enforce; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ResponseFormat:
    """What the output must be: any JSON object, or JSON valid against `schema`."""

    kind: FormatKind
    schema: dict[str, Any] | None = None
    name: str | None = None
