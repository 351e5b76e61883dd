"""The HTTP surface over a scripted engine: shapes, error mapping, disconnects, health."""

from __future__ import annotations

import json
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from server import streams
from server.app import create_app
from server.config import ServerConfig
from tests.server.fakes import FakeEngine, ThreadedServer
from tests.server.http_helpers import OpenStream, get, post

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def served():
    engine = FakeEngine()
    app = create_app(ServerConfig(max_body_bytes=4096), engine=engine)
    with ThreadedServer(app) as server:
        yield server, engine
    assert not engine.alive, "the app must stop its engine after the server stops"


@pytest.fixture
def url(served):
    server, engine = served
    engine.mode, engine.alive = "ok", True
    return server.url


@pytest.fixture
def engine(served):
    return served[1]


def test_completion_body(url):
    reply = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 4})
    assert reply.status == 200, reply.body
    body = reply.json()
    assert body["object"] == "text_completion" and body["model"] == "fake-model"
    assert body["choices"] == [{"index": 0, "text": "aaaa", "logprobs": None,
                                "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}


def test_chat_stream_with_usage(url):
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    reply = post(url, "/v1/chat/completions", body)
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/event-stream")
    data = reply.sse_data()
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "aaa"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}


def test_models(url):
    data = get(url, "/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["fake-model"]


def test_a_bad_request_never_reaches_the_engine(url, engine):
    before = len(engine.submitted)
    reply = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": "many"})
    assert reply.status == 400 and reply.error()["param"] == "max_tokens"
    assert len(engine.submitted) == before
    assert post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status == 200


def test_engine_full_is_429_with_retry_after(url, engine):
    engine.mode = "full"
    reply = post(url, "/v1/completions", {"prompt": "hi"})
    assert reply.status == 429 and reply.headers["retry-after"] == "3"
    error = reply.error()
    assert error["type"] == "rate_limit_error" and "queue is full" in error["message"]


def test_engine_dead_is_503(url, engine):
    engine.mode = "dead"
    reply = post(url, "/v1/chat/completions", CHAT)
    assert reply.status == 503 and "not running" in reply.error()["message"]


def test_a_failed_generation_is_500(url, engine):
    engine.mode = "error"
    reply = post(url, "/v1/completions", {"prompt": "hi"})
    assert reply.status == 500
    assert reply.error()["code"] == "generation_error"
    assert "sampling exploded" in reply.error()["message"]


def test_a_failed_stream_reports_the_error_in_band(url, engine):
    engine.mode = "error"
    data = post(url, "/v1/completions", {"prompt": "hi", "stream": True}).sse_data()
    assert data[-1] == "[DONE]"
    assert "sampling exploded" in json.loads(data[-2])["error"]["message"]


def test_engine_death_while_waiting_is_503_not_a_hang(url, engine, monkeypatch):
    monkeypatch.setattr(streams, "ENGINE_POLL_S", 0.05)
    engine.mode = "hang"
    stream = OpenStream(url, "/v1/completions", {"prompt": "hi", "stream": True})
    stream.read_event()
    engine.alive = False
    assert "engine thread has stopped" in stream.read_event()
    stream.drop()


def test_disconnect_mid_stream_aborts(url, engine):
    engine.mode = "hang"
    stream = OpenStream(url, "/v1/completions", {"prompt": "hi", "stream": True})
    assert json.loads(stream.read_event())["choices"][0]["text"] == "a"
    stream.drop()
    assert engine.wait_aborted(stream.request_id)


def test_a_queued_stream_gets_its_headers_at_once_and_aborts_when_dropped(url, engine):
    engine.mode = "queued"
    stream = OpenStream(url, "/v1/completions", {"prompt": "hi", "stream": True})
    assert stream.response.status == 200 and stream.request_id.startswith("cmpl-")
    stream.drop()
    assert engine.wait_aborted(stream.request_id)


def test_disconnect_while_waiting_for_a_whole_body_aborts(url, engine):
    engine.mode = "hang"
    before = len(engine.submitted)
    stream = None
    try:
        post(url, "/v1/completions", {"prompt": "hi"}, timeout_s=0.5)
    except TimeoutError:
        stream = engine.submitted[before]
    assert stream is not None
    assert engine.wait_aborted(stream.request_id)


def test_finished_requests_are_not_aborted(url, engine):
    reply = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    time.sleep(0.05)
    assert reply.json()["id"] not in engine.aborted


@pytest.mark.parametrize("method,path,status", [("GET", "/nope", 404),
                                                ("GET", "/v1/completions", 405)])
def test_routing_errors_are_openai_json(url, method, path, status):
    from tests.server.http_helpers import request

    reply = request(url, method, path)
    assert reply.status == status and reply.error()["message"]


def test_body_over_the_server_limit_is_413_json(url):
    reply = post(url, "/v1/completions", raw=b'{"prompt": "' + b"x" * 8000 + b'"}')
    assert reply.status == 413 and reply.error()["message"]


def test_health(url, engine):
    assert get(url, "/health").json()["status"] == "ok"
    engine.alive = False
    reply = get(url, "/health")
    assert reply.status == 503 and reply.json()["status"] == "unavailable"


def test_metrics_parse(url):
    reply = get(url, "/metrics")
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/plain")
    names = {f.name for f in text_string_to_metric_families(reply.body.decode())}
    assert "fairtick_requests_running" in names


def test_debug_trace_and_state(url):
    post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
    lines = get(url, "/debug/trace?since=0&limit=1").body.decode().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["trigger"] == "admit"
    assert get(url, "/debug/state").json()["policy"] == "fake_policy"


@pytest.mark.parametrize("query", ["since=-1", "since=x", "limit=0", "limit=1.5"])
def test_debug_trace_rejects_bad_queries(url, query):
    reply = get(url, f"/debug/trace?{query}")
    assert reply.status == 400 and reply.error()["param"] == query.split("=")[0]
