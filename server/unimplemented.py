"""What the body models declare but this server does not do yet: one table, one check.

The models (server/body_models.py, server/messages.py) accept these fields in OpenAI's shapes and
ranges; `refuse_unimplemented` then answers a body that asks for one with anything but its
no-op value with a 400 `unsupported_parameter` naming it. To implement a field: delete its row
below (or the clause of `_unsupported_in_message` for a part of a chat message) and read the
field where the body becomes work (server/validation.py `_sampling` for a sampling control),
with a test that it changes what is generated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from server.errors import ApiError, invalid
from server.messages import AssistantMessage, TextPart

COMPLETION, CHAT, TOKENIZE = "completion", "chat", "tokenize"
GENERATION = frozenset({COMPLETION, CHAT})


@dataclass(frozen=True)
class NotYet:
    """A field this server refuses unless it holds a no-op value: `accepts(value)` (after the
    model's validation; an absent or null field is never refused), `send` the values to send."""

    kinds: frozenset[str]
    field: str
    accepts: Callable[[Any], bool]
    send: str
    message: str = ""  # replaces "`field` is not supported by this server; send ... or null"


def _one(kind: str) -> frozenset[str]:
    return frozenset({kind})


NOT_YET: tuple[NotYet, ...] = (
    NotYet(GENERATION, "n", lambda v: v == 1, "1"),
    NotYet(_one(COMPLETION), "best_of", lambda v: v == 1, "1"),
    NotYet(GENERATION, "min_p", lambda v: v == 0, "0"),
    NotYet(GENERATION, "presence_penalty", lambda v: v == 0, "0"),
    NotYet(GENERATION, "frequency_penalty", lambda v: v == 0, "0"),
    NotYet(GENERATION, "repetition_penalty", lambda v: v == 1, "1"),
    NotYet(GENERATION, "logit_bias", lambda v: not v, "{}"),
    NotYet(_one(COMPLETION), "logprobs", lambda v: False, "null"),
    NotYet(_one(CHAT), "logprobs", lambda v: v is False, "false"),
    NotYet(_one(CHAT), "top_logprobs", lambda v: v == 0, "0"),
    NotYet(_one(COMPLETION), "echo", lambda v: v is False, "false"),
    NotYet(_one(COMPLETION), "suffix", lambda v: v == "", '""'),
    NotYet(_one(CHAT), "response_format", lambda v: v.type == "text", '{"type": "text"}'),
    NotYet(frozenset({CHAT, TOKENIZE}), "tools", lambda v: not v, "[]"),
    NotYet(_one(CHAT), "tool_choice", lambda v: v == "none", '"none"'),
    NotYet(_one(CHAT), "functions", lambda v: not v, "[]"),
    NotYet(_one(CHAT), "function_call", lambda v: v == "none", '"none"'),
    NotYet(_one(TOKENIZE), "continue_final_message", lambda v: v is False, "false"),
    NotYet(_one(TOKENIZE), "chat_template", lambda v: False, "null"),
    NotYet(_one(TOKENIZE), "chat_template_kwargs", lambda v: not v, "{}"),
    NotYet(_one(TOKENIZE), "mm_processor_kwargs", lambda v: not v, "{}"),
    NotYet(_one(COMPLETION), "prompt", lambda v: not _is_batch(v), "one prompt",
           "batched prompts are not supported; send one prompt per request"),
)


def _is_batch(prompt: Any) -> bool:
    # A list of strings or of token-id lists; a batch of one is that prompt (server/prompts.py).
    return isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list))


def refuse_unimplemented(kind: str, body: BaseModel) -> None:
    """A 400 `unsupported_parameter` for the first field of `body` this server does not do."""
    for row in NOT_YET:
        value = getattr(body, row.field, None) if kind in row.kinds else None
        if value is not None and not row.accepts(value):
            raise _unsupported(row.field, row.message or f"`{row.field}` is not supported by "
                               f"this server; send {row.send} or null")
    messages = getattr(body, "messages", None) or ()
    for index, message in enumerate(messages):
        for param, why in _unsupported_in_message(message, f"messages[{index}]"):
            raise _unsupported(param, f"`{param}` {why}")


def _unsupported_in_message(message: Any, param: str) -> Iterator[tuple[str, str]]:
    """(param, why) for what a message holds that the engine does not take: content parts
    other than text, tool calls."""
    if isinstance(message.content, list):
        for index, part in enumerate(message.content):
            if not isinstance(part, TextPart):
                yield (f"{param}.content[{index}]", f"is a {part.type!r} part; this server "
                       "takes only text parts ({\"type\": \"text\", \"text\": ...})")
    if isinstance(message, AssistantMessage):
        if message.tool_calls:
            yield (f"{param}.tool_calls", "is not supported by this server (it takes no "
                   "`tools`); send [] or leave it out")
        if message.function_call is not None:
            yield (f"{param}.function_call", "is not supported by this server (it takes no "
                   "`functions`); leave it out")


def _unsupported(param: str, message: str) -> ApiError:
    return invalid(message, param, code="unsupported_parameter")
