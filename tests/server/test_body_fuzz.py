"""No body gets a 5xx: Hypothesis sends generation bodies of OpenAI's documented shapes, with
wrong-typed, nested or extreme values put anywhere in them (scripts/reliabilitylib/bodies.py), to
the real app over the real engine on 127.0.0.1. Every answer is a completion or an OpenAI-style
4xx naming a field that was changed; afterwards the server still answers a valid request and
holds nothing. (test_validation_fuzz.py calls the validator directly, without HTTP.)"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from reliabilitylib.bodies import CHAT, FuzzedBody, fuzzed_bodies, top_level

from runtime.model import BUILTIN_CONFIG
from server.prompts import MAX_PROMPTS
from tests.server.http_helpers import Reply, post
from tests.server.serving import serve

# The body limit of `fairtick serve`'s default; generated bodies stay far below it.
MAX_BODY_BYTES = 4 * 1024 * 1024
SETTINGS = settings(max_examples=200, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def served(bundle):
    # A queue place for each prompt of the largest batch a changed `prompt` can be.
    with serve(bundle, max_body_bytes=MAX_BODY_BYTES, max_waiting=MAX_PROMPTS) as served:
        yield served


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
    """A 4xx is OpenAI's error object with a message; a 400 or 404 names a changed field."""
    error = reply.error()
    assert isinstance(error["message"], str) and error["message"], error
    assert error["type"] == "invalid_request_error", error
    if reply.status in (400, 404):
        assert error["param"] is not None, error
        assert top_level(error["param"]) in case.fields, (case.changed, error)


@SETTINGS
@given(case=fuzzed_bodies(BUILTIN_CONFIG["max_position_embeddings"]))
def test_no_body_gets_a_5xx(served, case):
    reply = post(served.url, case.path, raw=case.encoded())
    assert reply.status < 500, (case.changed, reply.body[:300])
    if reply.status < 300:
        check_completion(reply, case)
    else:
        assert 400 <= reply.status < 500
        check_error(reply, case)


def test_the_server_still_answers_after_the_fuzz(served):
    # Runs after test_no_body_gets_a_5xx (file order) on the same server.
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
