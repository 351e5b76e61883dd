"""The fuzz phase's requests: Hypothesis strategies for valid bodies with edge-case fields
(`field_cases`) and for malformed bytes, literals, encodings, content types, paths and methods
(`raw_cases`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st


@dataclass(frozen=True)
class Case:
    """One generated request: where, what bytes, which content type, and what it exercises."""

    path: str
    body: bytes
    content_type: str | None
    label: str  # "kind: detail"
    method: str = "POST"
    chunked: bool = False


EDGE_VALUES = [0, 1, -1, 2**31, 2**63, 2**64, 10**30, 10**400, -(10**400), 1e30, -0.0, 1e-320,
               float("nan"), float("inf"), float("-inf"), "", " ", "\x00", "\u2028", "é" * 50,
               [], {}, [[]], {"a": {"b": {}}}, True, False, None, 258, 255]
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n", "min_tokens",
          "ignore_eos", "logit_bias", "logprobs", "top_logprobs", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "min_p", "user", "best_of", "echo",
          "suffix", "response_format", "tools", "tool_choice", "metadata", "store",
          "parallel_tool_calls", "nonsense_field"]
MAX_FUZZ_TOKENS = 16  # a valid body never generates more than this (keeps the phase short)


def json_values() -> st.SearchStrategy[Any]:
    leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                       st.text(max_size=20), st.sampled_from(EDGE_VALUES))
    return st.recursive(leaves, lambda c: st.one_of(
        st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c, max_size=4)),
        max_leaves=12)


def bounded(body: dict[str, Any], context: int) -> dict[str, Any]:
    # A valid large max_tokens (or a chat without one) would generate for minutes: cap it.
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and \
                MAX_FUZZ_TOKENS < value <= context:
            body[name] = MAX_FUZZ_TOKENS
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_FUZZ_TOKENS
    return body


@st.composite
def field_cases(draw: st.DrawFn, context: int) -> Case:
    """A valid body of either endpoint with 1-4 fields set to edge values, dropped or added."""
    chat = draw(st.booleans())
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]} if chat else {
        "prompt": "hi"}
    body["max_tokens"] = draw(st.integers(1, 4))
    changed = []
    for _ in range(draw(st.integers(1, 4))):
        name = draw(st.sampled_from(FIELDS))
        if draw(st.integers(0, 5)) == 0:
            body.pop(name, None)
            changed.append(f"-{name}")
        else:
            body[name] = draw(st.one_of(st.sampled_from(EDGE_VALUES), json_values()))
            changed.append(name)
    body = bounded(body, context)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return Case(path, json.dumps(body).encode(), "application/json",
                f"{'chat' if chat else 'completion'} fields: {','.join(changed)}")


def raw_cases() -> st.SearchStrategy[Case]:
    """Malformed bytes, literals JSON does not allow, nesting, encodings, content types."""
    good = b'{"prompt": "hi", "max_tokens": 2}'
    paths = st.sampled_from(["/v1/completions", "/v1/chat/completions"])
    json_type = st.just("application/json")
    literal = st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400",
                               b"1" + b"0" * 5000, b"0x10", b"1_000", b"+1", b".5", b"01"])
    number_field = st.sampled_from([b"max_tokens", b"temperature", b"top_p", b"seed", b"n"])
    return st.one_of(
        st.builds(lambda p, b: Case(p, b, "application/json", "random bytes"),
                  paths, st.binary(max_size=300)),
        st.builds(lambda p, k: Case(p, good[:k], "application/json", "truncated JSON"),
                  paths, st.integers(0, len(good) - 1)),
        st.builds(lambda p, f, v: Case(p, b'{"prompt": "hi", "' + f + b'": ' + v + b"}",
                                       "application/json", "bad number literal"),
                  paths, number_field, literal),
        st.builds(lambda p, n: Case(p, b'{"prompt": "hi", "user": ' + b"[" * n + b"]" * n
                                    + b"}", "application/json", f"nesting: {n}"),
                  paths, st.integers(20, 20_000)),
        st.builds(lambda p, bad: Case(p, b'{"prompt": "' + bad + b'"}', "application/json",
                                      "bad encoding"),
                  paths, st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\\ud800",
                                          b"\\udc00\\ud800", b"\\u00", b"\x00", b"\\x41"])),
        st.builds(lambda p, c: Case(p, good, c, f"content type: {c!r}"), paths,
                  st.sampled_from(["text/plain", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x", "", None,
                                   "application/json; charset=utf-16", "application/xml",
                                   "application/problem+json", "APPLICATION/JSON"])),
        st.builds(lambda p, v: Case(p, json.dumps(v).encode(), "application/json",
                                    "not an object"), paths, json_values()),
        st.builds(lambda p, b: Case(p, b, "application/json", "empty or blank"), paths,
                  st.sampled_from([b"", b" ", b"\n\t", b"\xef\xbb\xbf{}"])),
        st.builds(lambda p, b: Case(p, b, "application/json", "array or null"), paths,
                  st.sampled_from([b'[{"prompt": "hi"}]', b"null", b'"hi"', b"7"])),
        st.builds(lambda p, m: Case(p.replace("completions", m), good, "application/json",
                                    f"path: {m}"), paths,
                  st.sampled_from(["completion", "completions/", "Completions", "x"])),
        st.builds(lambda p, m: Case(p, good, "application/json", f"method: {m}", method=m),
                  paths, st.sampled_from(["GET", "PUT", "DELETE", "PATCH"])),
        st.builds(lambda p, b: Case(p, b, "application/json", "chunked", chunked=True), paths,
                  st.sampled_from([good, good[:9], b'{"prompt": "' + b"y" * 300 + b'"}'])),
        json_type.map(lambda c: Case("/v1/completions", good, c, "valid control")),
    )
