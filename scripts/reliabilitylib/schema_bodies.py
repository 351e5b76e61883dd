"""Request bodies drawn from the body models' JSON schemas, then mutated.

`schema_bodies(context_length)` draws an endpoint (the two generation endpoints mostly, also
/tokenize and /detokenize) and a body valid per its model's JSON schema (server/body_models.py,
through json_schema.py): every declared field in every declared shape, nested messages, content
parts, tool calls, response formats, unknown extra keys. The schema is made small first
(`small`): short strings and lists, max_tokens at most MAX_BODY_TOKENS, token ids in [0, 256).
Half the bodies have the fields this server does not do yet set to their no-op values
(server/unimplemented.py `NOT_YET`), so more of them reach the engine. Then 0-3 places are
changed as bodies.py's `mutate` does (wrong types, nesting, extremes, removals).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from hypothesis import strategies as st

from reliabilitylib.bodies import (
    CHAT,
    COMPLETIONS,
    MAX_BODY_TOKENS,
    FuzzedBody,
    bound_tokens,
    mutate,
)
from reliabilitylib.json_schema import from_json_schema
from server.body_models import ChatBody, CompletionBody, DetokenizeBody, TokenizeBody
from server.unimplemented import NOT_YET

MODELS = {COMPLETIONS: CompletionBody, CHAT: ChatBody, "/tokenize": TokenizeBody,
          "/detokenize": DetokenizeBody}
KINDS = {COMPLETIONS: "completion", CHAT: "chat", "/tokenize": "tokenize"}
MAX_STRING, MAX_ITEMS, MAX_FREE_KEYS = 12, 3, 3
TOKEN_LIMITS = ("max_tokens", "max_completion_tokens", "min_tokens")


def small(node: Any) -> Any:
    """A copy of a JSON schema whose strings, lists and free-form objects are small, and whose
    unbounded integers (token ids) lie in [0, 256)."""
    if isinstance(node, list):
        return [small(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: small(value) for key, value in node.items()}
    kind = node.get("type")
    if kind == "string":
        node["maxLength"] = max(min(node.get("maxLength", MAX_STRING), MAX_STRING),
                                node.get("minLength", 0))
    elif kind == "array":
        node["maxItems"] = max(min(node.get("maxItems", MAX_ITEMS), MAX_ITEMS),
                               node.get("minItems", 0))
    elif kind == "object" and "properties" not in node:
        node["maxProperties"] = MAX_FREE_KEYS
    elif kind == "integer" and "minimum" not in node and "maximum" not in node:
        node.update(minimum=0, maximum=255)
    return node


def _cap_tokens(schema: dict[str, Any]) -> None:
    for name in TOKEN_LIMITS:
        for option in schema["properties"].get(name, {}).get("anyOf", []):
            if option.get("type") == "integer":
                option["maximum"] = MAX_BODY_TOKENS


@functools.cache
def body_strategy(path: str) -> st.SearchStrategy[dict[str, Any]]:
    """Bodies valid per the small JSON schema of `path`'s model (`model` left out: any other
    name than the served one is a 404, which mutations still reach)."""
    schema = small(MODELS[path].model_json_schema())
    schema["properties"].pop("model", None)
    _cap_tokens(schema)
    return from_json_schema(schema)


def with_no_ops(path: str, body: dict[str, Any]) -> None:
    """Set the fields of `NOT_YET` (those `path`'s body has) to their no-op values."""
    for row in NOT_YET:
        if KINDS.get(path) in row.kinds and row.field in body:
            if row.no_op is None:
                del body[row.field]
            else:
                body[row.field] = copy.deepcopy(row.no_op)


@st.composite
def schema_bodies(draw: st.DrawFn, context_length: int) -> FuzzedBody:
    """A body valid per its endpoint's JSON schema, with 0-3 places changed (see the module)."""
    path = draw(st.sampled_from([CHAT, CHAT, COMPLETIONS, COMPLETIONS, "/tokenize",
                                 "/detokenize"]))
    body = copy.deepcopy(draw(body_strategy(path)))
    if draw(st.booleans()):
        with_no_ops(path, body)
    names = sorted(MODELS[path].model_fields)
    changed = mutate(draw, body, names, counts=(0, 0, 1, 1, 2, 3))
    if path in (CHAT, COMPLETIONS):
        bound_tokens(body, context_length)
    return FuzzedBody(path, body, changed, base_accepted=False)
