"""Generation bodies of OpenAI's documented shapes with wrong values put anywhere inside them.

`fuzzed_bodies()` draws a body this server accepts (every field from its documented shape,
restricted to the values it supports: the no-op values of server/unimplemented.py's `NOT_YET`,
`tool_calls` [] or one call that the next message, a tool message, answers ...), then changes
1-3 places in it (`mutate`): a top-level field or any node nested in it
(`messages[1].content[0].text`, `stream_options.include_usage`, a `stop` item) is replaced by a
wrong-typed, nested or extreme value, or removed. schema_bodies.py draws bodies
from the models' JSON schemas and mutates them the same way. Used by
tests/server/test_body_fuzz.py and `scripts/reliability.py --phases bodies`. Strings never hold
lone surrogates (JSON cannot carry them as UTF-8 bytes).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from server.unimplemented import NOT_YET

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MAX_BODY_TOKENS = 16  # a body the server accepts never generates more (keeps a run short)

# Values that sit next to a documented shape: the other JSON types, numbers at and past every
# limit the API has, NaN and the infinities (sent as JSON's non-standard literals), bools (an
# int in Python), numeric strings, and the shapes of neighbouring fields.
EDGE_VALUES: list[Any] = [
    None, True, False, 0, 1, -1, 2, 4.0, 0.5, -0.0, 1e-320, 1e308, 2.0000001, 1.0000001, 100,
    101, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 10**30, 10**400, -(10**400),
    float("nan"), float("inf"), float("-inf"), "", " ", "1", "true", "null", "\x00", "\u2028",
    "user", "text", [], {}, [[]], [{}], [None], ["user"], [1, 2], {"type": "text"},
    {"type": "text", "text": 5}, [{"type": "text", "text": "a"}], {"role": "user"},
    {"include_usage": "yes"}, {"a": {"b": {"c": []}}},
    "x" * 300, ["s"] * 17,  # past the caps on a stop sequence's length and their count
]


def wrong_values() -> st.SearchStrategy[Any]:
    """Any JSON value, weighted to the edges, nested up to a few levels."""
    leaves = st.one_of(st.sampled_from(EDGE_VALUES), st.none(), st.booleans(), st.integers(),
                       st.floats(), st.text(max_size=12))
    return st.recursive(leaves, lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
        max_leaves=8)


def _text(min_size: int = 0) -> st.SearchStrategy[str]:
    return st.text(min_size=min_size, max_size=12)


def _optional(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({}, optional=fields)


def no_ops(kind: str) -> dict[str, st.SearchStrategy[Any]]:
    """The fields this server does not do yet, each at the no-op value it accepts."""
    return {row.field: st.just(row.no_op) for row in NOT_YET
            if kind in row.kinds and row.no_op is not None}


_TEXT_CONTENT = _text() | st.lists(st.fixed_dictionaries(
    {"type": st.just("text"), "text": _text()}), min_size=1, max_size=3)
_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user"]),
                           "content": _TEXT_CONTENT}, optional={"name": _text(1)}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": _TEXT_CONTENT | st.none()},
                          optional={"name": _text(1), "tool_calls": st.just([])}))
# A tool message answers a call of the assistant message before it (as OpenAI requires).
_ANSWERED_CALL = _text(1).flatmap(lambda call_id: st.tuples(
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.none(),
                           "tool_calls": st.just([{"id": call_id, "type": "function", "function": {
                               "name": "f", "arguments": "{}"}}])}),
    st.fixed_dictionaries({"role": st.just("tool"), "content": _TEXT_CONTENT,
                           "tool_call_id": st.just(call_id)})))
_MESSAGES = st.lists(_MESSAGE.map(lambda m: [m]) | _ANSWERED_CALL.map(list), min_size=1,
                     max_size=2).map(lambda turns: [m for turn in turns for m in turn])

_COMMON: dict[str, st.SearchStrategy[Any]] = {
    "temperature": st.floats(0.0, 2.0), "top_p": st.floats(0.01, 1.0),
    "top_k": st.integers(-1, 64), "seed": st.integers(0, 2**63 - 1),
    "stop": _text(1) | st.lists(_text(1), max_size=4),
    "min_tokens": st.integers(0, 1), "ignore_eos": st.booleans(),
    "logit_bias": st.dictionaries(st.integers(0, 255).map(str), st.floats(-100, 100),
                                  max_size=3),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2.0), "min_p": st.floats(0.0, 1.0),
    "user": _text(), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
}
_COMPLETION = {**_COMMON, **no_ops("completion"), "echo": st.booleans(),
               "logprobs": st.integers(0, 5)}
_CHAT = {
    **_COMMON, **no_ops("chat"), "max_completion_tokens": st.integers(1, 4),
    "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
    "parallel_tool_calls": st.booleans(), "store": st.booleans(),
    "metadata": st.dictionaries(_text(1), _text(), max_size=2)}
_PROMPTS = st.one_of(_text(1), st.lists(st.integers(0, 255), min_size=1, max_size=8),
                     _text(1).map(lambda t: [t]))

# A change to the key on the left can make the server name one on the right: a prompt that
# leaves no room for max_tokens, `stream` false beside `stream_options`, max below min_tokens,
# an `n` that `best_of` no longer equals (or is below), chat `logprobs` no longer true beside
# `top_logprobs`.
DEPENDS = {"prompt": {"max_tokens"}, "messages": {"max_tokens", "max_completion_tokens"},
           "stream": {"stream_options"}, "max_tokens": {"min_tokens"},
           "max_completion_tokens": {"min_tokens"}, "n": {"best_of"},
           "logprobs": {"top_logprobs"}}


# What a body needs in some form: the prompt of each endpoint, and room for its completion.
NEEDED = {"prompt", "messages", "tokens", "max_tokens", "max_completion_tokens"}


@dataclass(frozen=True)
class FuzzedBody:
    """One generated request: its endpoint, its body, and the places changed in it."""

    path: str
    body: dict[str, Any]
    changed: tuple[str, ...]  # "messages[0].role", "-stop" (removed), ...
    # The body before the changes was one this server accepts; else (a body drawn from a JSON
    # schema) a 4xx may name any field the body holds, or one it lacks and needs.
    base_accepted: bool = True

    @property
    def fields(self) -> set[str]:
        """The top-level fields a 4xx may name: those changed and those they constrain (with
        a base not known to be accepted, also those it holds or needs)."""
        names = {top_level(where.lstrip("-")) for where in self.changed}
        if not self.base_accepted:
            names |= set(self.body) | NEEDED
        return names.union(*(DEPENDS.get(name, set()) for name in names))

    def encoded(self) -> bytes:
        """The JSON bytes (NaN and the infinities as the literals Python's json writes)."""
        return json.dumps(self.body).encode()


def top_level(param: str) -> str:
    """The top-level field of a parameter path: `messages[0].role` -> `messages`."""
    return param.split("[")[0].split(".")[0]


@st.composite
def valid_bodies(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """An endpoint and a body of its documented shape that this server accepts."""
    chat = draw(st.booleans())
    body = draw(_optional(_CHAT if chat else _COMPLETION))
    if body.get("stream_options") is not None:
        body["stream"] = True
    if chat and body.get("top_logprobs"):
        body["logprobs"] = True
    if chat:
        body["messages"] = draw(_MESSAGES)
    else:
        body["prompt"] = draw(_PROMPTS)
    body["max_tokens"] = draw(st.integers(1, 4))
    return (CHAT if chat else COMPLETIONS), body


Steps = tuple[str | int, ...]


def _places(value: Any, steps: Steps) -> list[Steps]:
    """`steps` and the steps to every node under it (keys may hold dots: no string paths)."""
    found = [steps]
    if isinstance(value, dict):
        for key, child in value.items():
            found += _places(child, (*steps, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found += _places(child, (*steps, index))
    return found


def param_path(steps: Steps) -> str:
    """The parameter path OpenAI's errors use: ("messages", 0, "role") -> messages[0].role."""
    return "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in steps).lstrip(".")


def _change(body: dict[str, Any], steps: Steps, value: Any, remove: bool) -> None:
    *parents, last = steps
    node: Any = body
    for step in parents:
        node = node[step]
    if remove and isinstance(last, str):
        node.pop(last, None)
    else:
        node[last] = value


def mutate(draw: st.DrawFn, body: dict[str, Any], names: list[str],
           counts: tuple[int, ...] = (1, 1, 1, 2, 3)) -> tuple[str, ...]:
    """Change `draw(sampled_from(counts))` places of `body` (in place): a node anywhere in it,
    or a top-level field of `names` it lacks, gets a wrong value or (1 in 8) is removed; the
    changed paths ("messages[0].role", "-stop" for a removal)."""
    changed = []
    for _ in range(draw(st.sampled_from(counts))):
        absent: list[Steps] = [(name,) for name in names if name not in body]
        places = [p for key, v in body.items() for p in _places(v, (key,))] + absent
        if not places:
            break
        steps = draw(st.sampled_from(places))
        remove = draw(st.integers(0, 7)) == 0 and isinstance(steps[-1], str)
        _change(body, steps, copy.deepcopy(draw(wrong_values())), remove)
        changed.append(("-" if remove else "") + param_path(steps))
    return tuple(changed)


@st.composite
def fuzzed_bodies(draw: st.DrawFn, context_length: int) -> FuzzedBody:
    """A valid body with 1-3 places (top-level or nested) replaced by wrong values or removed;
    a `max_tokens` the server would accept is capped at MAX_BODY_TOKENS."""
    path, drawn = draw(valid_bodies())
    # Copies: st.just and EDGE_VALUES hand out shared objects, which the changes below edit.
    body = copy.deepcopy(drawn)
    fields = _CHAT if path == CHAT else _COMPLETION
    # Mostly one change: with more, an earlier check often refuses the body before the others.
    changed = mutate(draw, body, sorted({*fields, "max_tokens", "model", "messages", "prompt"}))
    bound_tokens(body, context_length)
    return FuzzedBody(path, body, changed)


def bound_tokens(body: dict[str, Any], context_length: int) -> None:
    """Cap a max_tokens the server would accept at MAX_BODY_TOKENS (chat's default is 2048)."""
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if type(value) is int and MAX_BODY_TOKENS < value <= context_length:
            body[name] = MAX_BODY_TOKENS
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_BODY_TOKENS
