"""`response_format` of a completions or chat request, read from its body model and compiled
off the event loop.

`{"type": "text"}` (or none) leaves the output free; `{"type": "json_object"}` makes it one JSON
object; `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`
makes it JSON valid against `schema`. The schema is always enforced, whatever `strict` says.
The body model (server/body_models.py) checks the shape, naming the exact part; whether the
grammar engine can enforce the schema is found by compiling it (`compile_response_format`), a
400 naming `response_format.json_schema.schema`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from runtime.formats import GrammarError, ResponseFormat
from server.body_models import JsonObjectFormat, JsonSchemaResponseFormat
from server.errors import invalid

if TYPE_CHECKING:  # runtime/grammar.py imports MLX; validation must not
    from runtime.grammar import Grammar
    from server.tool_request import ToolRequest


def read_response_format(value: Any) -> ResponseFormat | None:
    """The response format a body's validated `response_format` asks for (None: free text)."""
    if isinstance(value, JsonObjectFormat):
        return ResponseFormat("json_object")
    if isinstance(value, JsonSchemaResponseFormat):
        return ResponseFormat("json_schema", value.json_schema.schema_, value.json_schema.name)
    return None


def check_grammar_fields(response_format: ResponseFormat | None, tools: ToolRequest | None,
                         min_tokens: int | None, ignore_eos: bool | None) -> None:
    """A 400 for fields that conflict with a grammar: a response format beside offered tools
    (the output is either the format or calls), and min_tokens or ignore_eos beside a response
    format or a forced tool choice (the grammar decides where the output ends)."""
    if response_format is not None and tools is not None:
        raise invalid("`response_format` cannot be combined with `tools` unless `tool_choice` "
                      "is \"none\"", "response_format")
    forced = tools is not None and tools.choice.forced
    if response_format is None and not forced:
        return
    for name, value in (("min_tokens", min_tokens), ("ignore_eos", ignore_eos)):
        if value:
            raise invalid(f"`{name}` cannot be used with `response_format` or a forced "
                          "`tool_choice`: the grammar decides where the output ends", name)


async def compile_response_format(engine: Any, response_format: ResponseFormat | None
                                  ) -> Grammar | None:
    """The grammar of a response format, compiled on a worker thread (compiling can take
    milliseconds to seconds); a 400 naming the field when the grammar engine refuses it."""
    if response_format is None:
        return None
    return await compile_off_loop(lambda: _compile(engine, response_format))


async def compile_off_loop(build: Callable[[], Grammar | None]) -> Grammar | None:
    """`build()` on a worker thread; a GrammarError becomes a 400 naming its field."""
    loop = asyncio.get_running_loop()
    try:
        return await loop.run_in_executor(None, build)
    except GrammarError as exc:
        raise invalid(str(exc), exc.param) from None
    except ValueError as exc:  # the compiler cannot be built for this model's tokenizer
        raise invalid(f"`response_format` is not supported for this model: {exc}",
                      "response_format") from None


def _compile(engine: Any, response_format: ResponseFormat) -> Grammar:
    compiled: Grammar = engine.grammars.compile(response_format)
    return compiled
