"""No body gets a 5xx: Hypothesis sends bodies to the real app over the real engine on
127.0.0.1, of two kinds (scripts/reliabilitylib): bodies of OpenAI's documented shapes that this
server accepts, with wrong-typed, nested or extreme values put anywhere in them (bodies.py), and
bodies drawn from the body models' JSON schemas, unchanged or changed the same way, for the two
generation endpoints, /tokenize and /detokenize (schema_bodies.py). Every answer is a whole
answer or an OpenAI-style 4xx naming a field (one that was changed, for an accepted body); the
unknown fields of a body are named in `fairtick-ignored-fields`; afterwards the server still
answers a valid request and holds nothing. (test_validation_fuzz.py calls the validator
directly, without HTTP, with more examples.)"""

from __future__ import annotations

import json
import logging
import urllib.parse

import pytest
from hypothesis import HealthCheck, given, settings
from reliabilitylib.bodies import CHAT, COMPLETIONS, FuzzedBody, fuzzed_bodies, top_level
from reliabilitylib.schema_bodies import MODELS, schema_bodies

from runtime.limits import MAX_PROMPTS
from runtime.model import BUILTIN_CONFIG
from server.body_reading import IGNORED_FIELDS_HEADER
from tests.server.http_helpers import Reply, post
from tests.server.serving import serve

# The body limit of `fairtick serve`'s default; generated bodies stay far below it.
MAX_BODY_BYTES = 4 * 1024 * 1024
CONTEXT = BUILTIN_CONFIG["max_position_embeddings"]
SETTINGS = settings(max_examples=100, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def served(bundle):
    # A queue place for each prompt of the largest batch a changed `prompt` can be.
    with serve(bundle, max_body_bytes=MAX_BODY_BYTES, max_waiting=MAX_PROMPTS) as served:
        yield served


def check_answer(reply: Reply, case: FuzzedBody) -> None:
    """A 2xx is the endpoint's whole answer, a 4xx OpenAI's error naming a field the case may
    name; never a 5xx."""
    assert reply.status < 500, (case.path, case.changed, reply.body[:300])
    if reply.status >= 300:
        assert 400 <= reply.status < 500
        check_error(reply, case)
    elif case.path in (CHAT, COMPLETIONS):
        check_completion(reply, case)
        check_ignored_header(reply, case)
    else:
        body = reply.json()
        assert isinstance(body["tokens" if case.path == "/tokenize" else "prompt"], (list, str))
        check_ignored_header(reply, case)


def check_completion(reply: Reply, case: FuzzedBody) -> None:
    """A 2xx is a whole completion: SSE ending with [DONE], or a body with its choices (one,
    unless a change made `n` or a batch of prompts) in index order."""
    if reply.headers["content-type"].startswith("text/event-stream"):
        events = reply.sse_data()
        assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1])
        return
    body = reply.json()
    choices = body["choices"]
    assert [c["index"] for c in choices] == list(range(len(choices))) and choices
    for choice in choices:
        text = choice["message"]["content"] if case.path == CHAT else choice["text"]
        # The built-in model never emits EOS: it stops at max_tokens or at a stop sequence.
        assert choice["finish_reason"] in ("length", "stop") and isinstance(text, str)
    assert len(choices) <= body["usage"]["completion_tokens"] <= 16 * len(choices)


def check_error(reply: Reply, case: FuzzedBody) -> None:
    """A 4xx is OpenAI's error object with a message; a 400 or 404 names a field."""
    error = reply.error()
    assert isinstance(error["message"], str) and error["message"], error
    assert error["type"] == "invalid_request_error", error
    if reply.status in (400, 404):
        assert error["param"] is not None, error
        assert top_level(error["param"]) in case.fields, (case.changed, error)


def check_ignored_header(reply: Reply, case: FuzzedBody) -> None:
    """The top-level fields the model does not declare are named, percent-encoded."""
    unknown = [name for name in case.body if name not in MODELS[case.path].model_fields]
    named = reply.headers.get(IGNORED_FIELDS_HEADER, "")
    if unknown and "more)" not in named:
        names = {urllib.parse.unquote(n) for n in named.split(", ")}
        for field in unknown:  # a long one by its start
            assert field in names or any(n.endswith("...") and field.startswith(n[:-3])
                                         for n in names), (field, named)


@SETTINGS
@given(case=fuzzed_bodies(CONTEXT))
def test_no_documented_body_with_wrong_values_gets_a_5xx(served, case):
    check_answer(post(served.url, case.path, raw=case.encoded()), case)


@settings(SETTINGS, max_examples=150)
@given(case=schema_bodies(CONTEXT))
def test_no_body_drawn_from_the_json_schemas_gets_a_5xx(served, case):
    check_answer(post(served.url, case.path, raw=case.encoded()), case)


def test_the_server_still_answers_after_the_fuzz(served):
    # Runs after the two fuzz tests above (file order) on the same server.
    served.wait_idle()
    reply = post(served.url, "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert reply.status == 200, reply.body
    assert reply.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("message", [
    {"role": {"name": "user"}, "content": "hi"},
    {"role": "assistant", "content": "hi", "tool_calls": {"id": "call_1"}},
])
def test_the_two_bodies_that_answered_500_are_400s_naming_the_field(served, message):
    reply = post(served.url, "/v1/chat/completions", {"messages": [message], "max_tokens": 2})
    assert reply.status == 400, reply.body
    field = "role" if isinstance(message["role"], dict) else "tool_calls"
    assert reply.error()["param"] == f"messages[0].{field}"


def test_long_unknown_fields_are_named_by_their_start_in_a_bounded_header(served, caplog):
    # One 70,000-character key made a header line that Python's http.client (requests) refuses
    # past 64 KiB, so the 200 could not be read; sixteen 5,000-character keys likewise.
    long_key = "k" * 70_000
    with caplog.at_level(logging.WARNING, logger="fairtick.server"):
        reply = post(served.url, "/v1/chat/completions",
                     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                      long_key: 1, **{f"{i:02}" + "v" * 4_998: i for i in range(16)}})
    assert reply.status == 200, reply.body
    names = reply.headers[IGNORED_FIELDS_HEADER].split(", ")
    assert names[0] == "k" * 64 + "..."
    assert names[1] == "00" + "v" * 62 + "..."
    assert names[16:] == ["... (1 more)"]
    [line] = [r.getMessage() for r in caplog.records if "ignored unknown fields" in r.getMessage()]
    assert long_key in line  # the log names each one whole
    # Percent-encoded, a 64-character name of 3-byte characters takes 579 bytes: the names stop
    # before the header passes 4 KiB.
    reply = post(served.url, "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                  **{f"{i:02}" + "€" * 98: i for i in range(20)}})
    assert reply.status == 200, reply.body
    named = reply.headers[IGNORED_FIELDS_HEADER]
    names = named.split(", ")
    assert len(named) <= 4096 and len(names) == 8
    assert urllib.parse.unquote(names[0]) == "00" + "€" * 62 + "..."
    assert names[-1] == "... (13 more)"


def test_unknown_fields_are_ignored_named_in_a_header_and_streamed_too(served, caplog):
    body = {"messages": [{"role": "user", "content": "hi", "cache_control": {"type": "x"}}],
            "max_tokens": 2, "stop_token_ids": [1], "x\r\nSet-Cookie: a": 1}
    with caplog.at_level(logging.WARNING, logger="fairtick.server"):
        reply = post(served.url, "/v1/chat/completions", body)
    assert reply.status == 200 and reply.json()["usage"]["completion_tokens"] == 2
    [line] = [r.getMessage() for r in caplog.records if "ignored unknown fields" in r.getMessage()]
    assert line.endswith('["stop_token_ids", "x\\r\\nSet-Cookie: a", "messages[0].cache_control"]')
    # A key's CR and LF are percent-encoded: no header of the client's making.
    assert reply.headers[IGNORED_FIELDS_HEADER] == (
        "stop_token_ids, x%0D%0ASet-Cookie:%20a, messages[0].cache_control")
    assert "set-cookie" not in reply.headers
    streamed = post(served.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                                    "stream": True, "best_of_n": 3})
    assert streamed.sse_data()[-1] == "[DONE]"
    assert streamed.headers[IGNORED_FIELDS_HEADER] == "best_of_n"
    known = post(served.url, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert IGNORED_FIELDS_HEADER not in known.headers
