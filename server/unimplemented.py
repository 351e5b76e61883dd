"""What the body models declare but this server does not do yet: one table, one check.

The models (server/body_models.py, server/messages.py) accept these fields in OpenAI's shapes and
ranges; `refuse_unimplemented` then answers a body that asks for one with anything but its
no-op value with a 400 `unsupported_parameter` naming it. What is refused: the fields of
`NOT_YET`, a completions `best_of` other than `n`, and in chat messages content parts other
than text and the deprecated `function_call` (`_unsupported_in_message`). To implement one:
delete its row or clause here and read the field where the body becomes work
(server/sampling_fields.py `sampling_params` for a sampling control), with a test that it
changes what is generated.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from server.errors import ApiError, invalid
from server.messages import AssistantMessage, TextPart

COMPLETION, CHAT, TOKENIZE = "completion", "chat", "tokenize"
GENERATION = frozenset({COMPLETION, CHAT})


@dataclass(frozen=True)
class NotYet:
    """A field this server refuses unless it is null or holds its no-op value (`no_op`, as
    JSON; None: only null)."""

    kinds: frozenset[str]
    field: str
    no_op: Any = None

    def accepts(self, value: Any) -> bool:
        """Whether a validated, non-null `value` of the field asks for nothing."""
        if isinstance(value, BaseModel):  # its declared fields only: unknown ones are ignored
            value = value.model_dump(mode="json", exclude_none=True,
                                     include=set(type(value).model_fields))
        return self.no_op is not None and value == self.no_op


def _one(kind: str) -> frozenset[str]:
    return frozenset({kind})


NOT_YET: tuple[NotYet, ...] = (
    NotYet(_one(COMPLETION), "suffix", ""),
    NotYet(_one(CHAT), "functions", []),
    NotYet(_one(CHAT), "function_call", "none"),
    NotYet(_one(TOKENIZE), "continue_final_message", False),
    NotYet(_one(TOKENIZE), "chat_template"),
    NotYet(_one(TOKENIZE), "chat_template_kwargs", {}),
    NotYet(_one(TOKENIZE), "mm_processor_kwargs", {}),
)


def refuse_unimplemented(kind: str, body: BaseModel) -> None:
    """A 400 `unsupported_parameter` for the first field of `body` this server does not do."""
    for row in NOT_YET:
        value = declared(body, row.field) if kind in row.kinds else None
        if value is not None and not row.accepts(value):
            send = "null" if row.no_op is None else f"{json.dumps(row.no_op)} or null"
            raise _unsupported(row.field, f"`{row.field}` is not supported by this server; "
                               f"send {send}")
    best_of, n = declared(body, "best_of"), declared(body, "n") or 1
    if kind == COMPLETION and best_of is not None and best_of != n:
        # `n` choices share one prefill; ranking extra candidates by likelihood is not done.
        raise _unsupported("best_of", f"`best_of` other than `n` ({n}) is not supported: this "
                           "server does not generate extra candidates to rank; send best_of "
                           "equal to n, or leave it out")
    for index, message in enumerate(declared(body, "messages") or ()):
        for param, why in _unsupported_in_message(message, f"messages[{index}]"):
            raise _unsupported(param, f"`{param}` {why}")


def declared(body: BaseModel, name: str) -> Any:
    """The value of a field `body`'s model declares; None for an unknown one (pydantic makes
    the ignored unknown fields attributes too)."""
    return getattr(body, name) if name in type(body).model_fields else None


def _unsupported_in_message(message: Any, param: str) -> Iterator[tuple[str, str]]:
    """(param, why) for what a message holds that the engine does not take: content parts
    other than text, the deprecated `function_call` (`tool_calls` are taken)."""
    if isinstance(message.content, list):
        for index, part in enumerate(message.content):
            if not isinstance(part, TextPart):
                yield (f"{param}.content[{index}]", f"is a {part.type!r} part; this server "
                       "takes only text parts ({\"type\": \"text\", \"text\": ...})")
    if isinstance(message, AssistantMessage) and message.function_call is not None:
        yield (f"{param}.function_call", "is not supported by this server (it takes no "
               "`functions`); send the call in `tool_calls`")


def _unsupported(param: str, message: str) -> ApiError:
    return invalid(message, param, code="unsupported_parameter")
