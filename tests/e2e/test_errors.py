"""Bad requests against the real server: OpenAI-style 4xx naming the field, and no effect on
anyone else's output."""

from __future__ import annotations

import socket
import urllib.parse

import pytest

from tests.server.http_helpers import post

GOOD = {"prompt": "fair", "max_tokens": 4}


def completion_text(server) -> str:
    reply = post(server.url, "/v1/completions", GOOD)
    assert reply.status == 200, reply.body
    return str(reply.json()["choices"][0]["text"])


@pytest.mark.parametrize("raw,param,words", [
    (b'{"prompt": "x",', None, "not valid JSON"),
    (b'{"prompt": "\xff"}', None, "UTF-8"),
    (b'{"max_tokens": NaN, "prompt": "x"}', "max_tokens", "NaN"),
    (b'{"a":' + b"[" * 200 + b"]" * 200 + b"}", None, "nested"),
    (b'{"prompt": "x", "temperature": -Infinity}', "temperature", "-Infinity"),
    (b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", None, "not valid JSON"),
    (b'{"prompt": "\\udc00"}', None, "surrogate"),
    (b"", None, "empty"),
])
def test_malformed_bodies(server, raw, param, words):
    reply = post(server.url, "/v1/completions", raw=raw)
    error = reply.error()
    assert reply.status == 400 and error["param"] == param and words in error["message"]


@pytest.mark.parametrize("body,param", [
    ({}, "prompt"),
    ({"prompt": 3}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**9}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1e30}, "max_tokens"),
    ({"prompt": "x", "stop": 7}, "stop"),
    ({"prompt": "x", "n": 65}, "n"),
    ({"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": ["x", 5]}, "prompt[1]"),  # a batch mixes strings and ids: the odd one named
    ({"prompt": [[1], []]}, "prompt[1]"),
    ({"prompt": "x", "logprobs": 6}, "logprobs"),
    ({"prompt": "x", "logit_bias": {"999999": 5}}, "logit_bias"),
    ({"prompt": "x", "seed": -5}, "seed"),
    ({"prompt": [1, 10**6]}, "prompt[1]"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "temperature": 10**400}, "temperature"),
    ({"prompt": "x", "top_p": "1"}, "top_p"),
    ({"prompt": "x", "stop": ["a", 1]}, "stop[1]"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"prompt": "x", "logit_bias": {"7": 1, "007": 2}}, "logit_bias"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "min_p": 2}, "min_p"),
    ({"prompt": "x", "suffix": "tail"}, "suffix"),  # still refused: not implemented
    ({"prompt": "x", "seed": 2**64}, "seed"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
])
def test_invalid_fields(server, body, param):
    reply = post(server.url, "/v1/completions", body)
    assert reply.status == 400, reply.body
    assert reply.error()["param"] == param


def test_an_unknown_field_is_ignored_and_named(server):
    reply = post(server.url, "/v1/completions", {**GOOD, "wat": 1})
    assert reply.status == 200 and reply.headers["fairtick-ignored-fields"] == "wat"


def test_a_number_too_large_for_a_float(server):
    reply = post(server.url, "/v1/completions", raw=b'{"prompt": "x", "temperature": 1e400}')
    assert reply.status == 400 and reply.error()["param"] == "temperature"


def test_chat_field_errors(server):
    reply = post(server.url, "/v1/chat/completions", {"messages": [{"role": "x", "content": ""}]})
    assert reply.status == 400 and reply.error()["param"] == "messages[0].role"


def test_a_tool_message_needs_its_tool_call_id(server):
    messages = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]
    reply = post(server.url, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert reply.status == 400, reply.body
    error = reply.error()
    assert error["param"] == "messages[1].tool_call_id"
    assert error["message"] == "`messages[1].tool_call_id` is required: a string"


def test_metadata_over_16_entries_says_how_many_were_sent(server):
    metadata = {f"k{i}": "v" for i in range(17)}
    reply = post(server.url, "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "hi"}], "metadata": metadata})
    assert reply.status == 400 and reply.error()["param"] == "metadata"
    assert reply.error()["message"].endswith("at most 16 items, got 17 items")


def test_a_batch_more_than_max_waiting_could_never_queue_is_400(server):
    # The server runs with --max-waiting 2; a 429 would have the client retry for ever.
    reply = post(server.url, "/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 2})
    assert reply.status == 400 and "retry-after" not in reply.headers, reply.body
    error = reply.error()
    assert (error["type"], error["param"]) == ("invalid_request_error", "prompt")
    assert "3 prompts" in error["message"] and "--max-waiting 2" in error["message"]
    assert "at most 2 prompts" in error["message"]
    fits = post(server.url, "/v1/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 2})
    assert fits.status == 200 and len(fits.json()["choices"]) == 4, fits.body


def test_unknown_model_is_404(server):
    reply = post(server.url, "/v1/completions", {**GOOD, "model": "gpt-4o"})
    assert reply.status == 404 and reply.error()["code"] == "model_not_found"


def test_prompt_longer_than_the_context(server, model_name):
    from tests.server.http_helpers import get

    context = get(server.url, "/v1/models").json()["data"][0]["max_model_len"]
    reply = post(server.url, "/v1/completions", {"prompt": [65] * (context + 1)})
    error = reply.error()
    assert reply.status == 400 and error["param"] == "prompt"
    assert error["code"] == "context_length_exceeded"
    assert f"the {context + 1} tokens of the prompt leave no room" in error["message"]
    chat = post(server.url, "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "a" * context}]})
    error = chat.error()
    assert chat.status == 400 and error["param"] == "messages"
    assert " tokens of the messages leave no room to generate" in error["message"], error


def test_wrong_content_type_is_415(server):
    reply = post(server.url, "/v1/completions", raw=b"prompt=x",
                 content_type="application/x-www-form-urlencoded")
    assert reply.status == 415 and "application/json" in reply.error()["message"]


def test_body_too_large_is_413_before_it_is_read(server):
    # Only the headers are sent: the server must answer from Content-Length alone.
    url = urllib.parse.urlparse(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 50000000\r\n\r\n")
        head, _, body = sock.makefile("rb").read().partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"413", head
    assert b'"error"' in body


def test_bad_requests_change_nothing_for_good_ones(server):
    before = completion_text(server)
    for body in ({"prompt": "x", "temperature": -1}, {"prompt": "", "stop": [""]},
                 {"prompt": "x", "top_k": -7}, {"prompt": None}):
        assert post(server.url, "/v1/completions", body).status == 400
    assert completion_text(server) == before
