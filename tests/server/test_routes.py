"""The HTTP surface over the real engine and the built-in model: shapes, error mapping, admission
control, fault isolation, engine death, disconnects, health.

Rare conditions are produced for real: one slot held by a long stream (a full queue, a queued
request), a small KV budget, a fault injected into one request's prefill or decode, a scheduler
fault that kills the engine thread, the engine thread held inside a real prefill chunk. Tests
wait for the state they need (/debug/state, the trace), never for time to pass.
"""

from __future__ import annotations

import gzip
import json
import socket
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.lifecycle_names import (
    ABORT,
    ADMIT,
    CHUNK_DONE,
    DECODING,
    FINISH,
    PARKED,
    PREFILLING,
    WAITING,
)
from tests.runtime.engine_harness import hold as hold_call
from tests.server.http_helpers import OpenStream, SentRequest, get, post, request
from tests.server.serving import POISON, poison_prompts, serve

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
LONG = 20_000  # max_tokens of a stream that a test cuts off long before it ends


@pytest.fixture(scope="module")
def one_slot(bundle):
    """One running place, a queue of one: a long stream makes the next request wait, the one
    after 429."""
    with serve(bundle, max_running=1, max_waiting=1) as served:
        yield served


@pytest.fixture
def served(one_slot):
    one_slot.wait_idle()
    yield one_slot
    one_slot.wait_idle()


@pytest.fixture
def two_slots(bundle):
    with serve(bundle, max_running=2, max_waiting=2) as served:
        yield served


def hold(served, prompt: str = "hold") -> OpenStream:
    """A stream that has its first token: it holds the running place (decoding) until
    dropped."""
    stream = OpenStream(served.url, "/v1/completions",
                        {"prompt": prompt, "max_tokens": LONG, "stream": True})
    stream.read_event()
    return stream


def rest(stream: OpenStream, limit: int = 10_000) -> list[str]:
    """The stream's remaining `data:` payloads up to and including [DONE]."""
    events = []
    while len(events) < limit:
        events.append(stream.read_event())
        if events[-1] == "[DONE]":
            return events
    raise AssertionError(f"no [DONE] in {limit} events")


def sse_text(events: list[str]) -> str:
    return "".join(json.loads(e)["choices"][0]["text"] for e in events
                   if e.startswith("{") and json.loads(e).get("choices"))


def seq_of(served, request_id: str) -> int:
    return next(s["seq"] for s in served.state()["sequences"] if s["request_id"] == request_id)


# --- shapes ------------------------------------------------------------------------------------

def test_completion_body(served, bundle):
    reply = post(served.url, "/v1/completions", {"prompt": "hi", "max_tokens": 4})
    assert reply.status == 200, reply.body
    body = reply.json()
    assert body["object"] == "text_completion" and body["model"] == bundle.name
    [choice] = body["choices"]
    assert (choice["index"], choice["logprobs"], choice["finish_reason"]) == (0, None, "length")
    # The built-in model emits one printable character per token and never EOS.
    assert len(choice["text"]) == 4 and choice["text"].isprintable()
    num_prompt = len(bundle.tokenizer.encode("hi"))
    assert body["usage"] == {"prompt_tokens": num_prompt, "completion_tokens": 4,
                             "total_tokens": num_prompt + 4,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    again = post(served.url, "/v1/completions", {"prompt": "hi", "max_tokens": 4}).json()
    assert again["choices"][0]["text"] == choice["text"], "greedy output is reproducible"


def test_whole_responses_carry_their_id_in_x_request_id(served):
    # As streams always did: the id the log and the trace name the request by.
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions", CHAT)):
        reply = post(served.url, path, body)
        assert reply.status == 200, reply.body
        assert reply.headers["x-request-id"] == reply.json()["id"]


def test_chat_stream_with_usage(served):
    whole = post(served.url, "/v1/chat/completions", CHAT).json()
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    reply = post(served.url, "/v1/chat/completions", body)
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/event-stream")
    data = reply.sse_data()
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    # OpenAI's shape: every chunk but the usage chunk says "usage": null.
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1]), chunks
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"] and len(text) == 3
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    # The same prompt again: all but its last token came from the prefix cache.
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["prompt_tokens_details"] == \
        {"cached_tokens": whole["usage"]["prompt_tokens"] - 1}
    assert {**usage, "prompt_tokens_details": None} == \
        {**whole["usage"], "prompt_tokens_details": None}
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert reply.headers["x-request-id"] == chunks[0]["id"]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3}),
    ("/v1/chat/completions", CHAT),
])
def test_usage_null_on_every_chunk_only_when_usage_is_asked_for(served, path, body):
    asked = post(served.url, path, {**body, "stream": True,
                                    "stream_options": {"include_usage": True}})
    chunks = [json.loads(d) for d in asked.sse_data()[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert [c["usage"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    for options in ({}, {"stream_options": {"include_usage": False}}):
        plain = post(served.url, path, {**body, "stream": True, **options})
        chunks = [json.loads(d) for d in plain.sse_data()[:-1]]
        assert chunks and all("usage" not in c for c in chunks), chunks


def test_models(served, bundle):
    [card] = get(served.url, "/v1/models").json()["data"]
    assert card["id"] == bundle.name and card["max_model_len"] == bundle.context_length


def test_a_bad_request_never_reaches_the_engine(served):
    before = len(served.trace())
    reply = post(served.url, "/v1/completions", {"prompt": "hi", "max_tokens": "many"})
    assert reply.status == 400 and reply.error()["param"] == "max_tokens"
    assert len(served.trace()) == before, "no sequence was admitted"
    assert post(served.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status == 200


# --- admission control -------------------------------------------------------------------------

def test_a_full_queue_is_429_with_retry_after_at_once(served):
    holder = hold(served)
    queued = OpenStream(served.url, "/v1/completions",
                        {"prompt": "queued", "max_tokens": 3, "stream": True})
    assert queued.response.status == 200, "a queued stream gets its headers at once"
    full = sorted([DECODING, WAITING])
    served.wait_for(lambda s: sorted(q["state"] for q in s["sequences"]) == full)
    before = len(served.trace())
    reply = post(served.url, "/v1/completions", {"prompt": "one too many"})
    assert reply.status == 429 and int(reply.headers["retry-after"]) >= 1
    error = reply.error()
    assert error["type"] == "rate_limit_error" and error["code"] == "server_busy"
    assert "--max-waiting 1" in error["message"]
    # Answered at once: while the slot and the queue were still full, so it never waited for
    # room, and it never reached the scheduler.
    state = served.state()
    assert sorted(s["state"] for s in state["sequences"]) == full
    assert state["admission"]["queued"] == 1
    # The scheduler never saw it: the trace holds only its refusal.
    [refusal] = served.trace()[before:]
    assert (refusal["kind"], refusal["rule"], refusal["seq"]) == ("refusal", "queue_full", None)
    assert refusal["request_id"].startswith("cmpl-")
    assert reply.headers["x-request-id"] == refusal["request_id"], "the refusal is findable"
    holder.drop()
    events = rest(queued)
    assert len(sse_text(events)) == 3, "the queued request runs once the slot is free"


def test_a_body_that_stalls_is_408_at_the_request_timeout_and_the_connection_closes(bundle):
    # Headers, then 10 of 100 declared bytes, then nothing: the connection was held for the
    # response timeout (an hour), one stalled client per connection.
    with serve(bundle, server={"request_timeout_s": 1.0}) as served:
        host, port = served.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 100\r\n\r\n" + b'{"prompt"' + b" ")
            start, data = time.monotonic(), b""
            while chunk := sock.recv(65536):  # to the connection's end
                data += chunk
            waited = time.monotonic() - start
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and 0.9 < waited < 10, (head, waited)
        error = json.loads(body)["error"]
        assert error["code"] == "request_timeout"
        assert "the request body did not arrive within 1 s" in error["message"]
        # A whole body on time is served as before.
        assert post(served.url, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status == 200


def test_a_request_over_the_whole_kv_budget_is_400_and_a_short_budget_queues(bundle):
    with serve(bundle, max_running=4, max_waiting=4, max_kv_tokens=400) as served:
        reply = post(served.url, "/v1/completions", {"prompt": "x", "max_tokens": 400})
        assert reply.status == 400 and reply.error()["param"] == "prompt"
        assert "must fit the KV budget of 400 tokens" in reply.error()["message"]
        # A batch's prompt is named by its place, as its context error is.
        reply = post(served.url, "/v1/completions", {"prompt": ["x", "y" * 390],
                                                     "max_tokens": 20})
        assert reply.status == 400 and reply.error()["param"] == "prompt[1]"
        assert reply.error()["message"].startswith("prompt[1]: prompt (391 tokens) plus "
                                                   "max_tokens (20) must fit the KV budget")
        served.wait_idle()  # the first prompt, handed over, is aborted
        # Three requests that need 3 x 300 of the 400 tokens: the budget, not a refusal,
        # decides who runs when; every one completes.
        streams = [OpenStream(served.url, "/v1/completions",
                              {"prompt": f"p{i}", "max_tokens": 290, "stream": True})
                   for i in range(3)]
        for stream in streams:
            assert len(sse_text(rest(stream))) == 290
        state = served.state()
        assert state["kv"]["budget_tokens"] == 400
        served.wait_idle()


# --- fault isolation and engine death ----------------------------------------------------------

def test_a_failed_prefill_is_500_and_other_requests_continue(two_slots, monkeypatch):
    body = {"prompt": "healthy", "max_tokens": 40}
    expected = post(two_slots.url, "/v1/completions", body).json()["choices"][0]["text"]
    poison_prompts(two_slots.engine, monkeypatch, "prefill")
    healthy = OpenStream(two_slots.url, "/v1/completions", {**body, "stream": True})
    first = healthy.read_event()
    reply = post(two_slots.url, "/v1/completions", {"prompt": POISON.decode(), "max_tokens": 4})
    assert reply.status == 500
    error = reply.error()
    assert error["code"] == "generation_error" and error["type"] == "server_error"
    assert "injected fault in prefill" in error["message"]
    assert reply.headers["x-request-id"].startswith("cmpl-")
    assert sse_text([first, *rest(healthy)]) == expected, "the other stream is unaffected"
    two_slots.wait_idle()
    assert get(two_slots.url, "/health").json()["status"] == "ok"


def test_a_failed_decode_ends_the_stream_with_an_in_band_error(two_slots, monkeypatch):
    poison_prompts(two_slots.engine, monkeypatch, "decode")
    reply = post(two_slots.url, "/v1/completions",
                 {"prompt": POISON.decode(), "max_tokens": 8, "stream": True})
    assert reply.status == 200
    data = reply.sse_data()
    assert data[-1] == "[DONE]"
    assert len(sse_text(data[:-2])) == 1, "the prefill's token arrives before the failure"
    error = json.loads(data[-2])["error"]
    assert error["code"] == "generation_error" and "injected fault in decode" in error["message"]
    two_slots.wait_idle()
    assert post(two_slots.url, "/v1/completions", {"prompt": "next"}).status == 200


def test_engine_death_ends_every_request_with_503_and_health_says_so(bundle, monkeypatch):
    with serve(bundle, max_running=1, max_waiting=1) as served:
        running = hold(served)
        queued = OpenStream(served.url, "/v1/completions",
                            {"prompt": "queued", "max_tokens": 3, "stream": True})
        served.wait_for(lambda s: s["admission"]["queued"] == 1)

        def broken(*args, **kwargs):
            raise RuntimeError("injected scheduler fault")

        # A scheduler failure is outside any one request's work: it kills the engine thread.
        monkeypatch.setattr(served.engine.scheduler, "schedule", broken)
        for stream in (running, queued):
            events = rest(stream)
            error = json.loads(events[-2])["error"]
            assert error["code"] == "engine_unavailable"
            assert "injected scheduler fault" in error["message"]
        health = get(served.url, "/health")
        assert health.status == 503 and health.json()["status"] == "unavailable"
        reply = post(served.url, "/v1/chat/completions", CHAT)
        assert reply.status == 503 and "not running" in reply.error()["message"]


# --- disconnects -------------------------------------------------------------------------------

def test_disconnect_mid_stream_aborts_the_sequence(served):
    before = len(served.trace())
    stream = hold(served)
    seq = seq_of(served, stream.request_id)
    stream.drop()
    served.wait_idle()
    events = [e for e in served.trace(before) if e["seq"] == seq]
    assert (events[-1]["trigger"], events[-1]["from"]) == (ABORT, DECODING), events[-3:]


def test_a_queued_stream_leaves_the_queue_when_dropped(served):
    holder = hold(served)
    queued = OpenStream(served.url, "/v1/completions",
                        {"prompt": "queued", "max_tokens": 4, "stream": True})
    assert queued.response.status == 200 and queued.request_id.startswith("cmpl-")
    served.wait_for(lambda s: any(q["request_id"] == queued.request_id and q["state"] == WAITING
                                  for q in s["sequences"]))
    queued.drop()
    served.wait_for(lambda s: s["admission"]["queued"] == 0 and len(s["sequences"]) == 1)
    holder.drop()


def test_a_chat_without_max_tokens_runs_within_a_small_kv_budget(bundle):
    # Its 2048 default is cut to the room the budget leaves (a 400 naming max_tokens, which the
    # client never sent, before).
    with serve(bundle, max_kv_tokens=300) as served:
        reply = post(served.url, "/v1/chat/completions",
                     {"messages": [{"role": "user", "content": "hi"}]})
        assert reply.status == 200, reply.json()
        usage = reply.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 300
        assert reply.json()["choices"][0]["finish_reason"] == "length"
        sent = post(served.url, "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2048})
        # Sent, it is the client's: refused, naming the budget.
        assert sent.status == 400, sent.json()
        assert "plus max_tokens (2048) must fit the KV budget of 300 tokens" in \
            sent.json()["error"]["message"]


def test_debug_state_names_a_batchs_sequences_by_the_id_the_client_saw(bundle):
    with serve(bundle, max_running=2, max_waiting=2) as served:
        batch = OpenStream(served.url, "/v1/completions",
                           {"prompt": ["a", "b"], "max_tokens": LONG, "stream": True})
        assert batch.response.status == 200
        served.wait_for(lambda s: len(s["sequences"]) == 2)
        ids = {q["request_id"] for q in served.state()["sequences"]}
        assert ids == {batch.request_id}, ids  # not the internal ID-0, ID-1
        batch.drop()
        served.wait_idle()


def test_disconnect_while_waiting_for_a_whole_body_aborts(served):
    before = len(served.trace())
    whole = SentRequest(served.url, "/v1/completions", {"prompt": "whole", "max_tokens": LONG})
    served.wait_for(lambda s: [(q["state"], q["generated"] > 0) for q in s["sequences"]]
                    == [(DECODING, True)])
    whole.drop()
    served.wait_idle()
    aborts = [e for e in served.trace(before) if e["trigger"] == ABORT]
    assert len(aborts) == 1 and aborts[0]["from"] == DECODING, aborts


def test_disconnect_while_prefilling_stops_after_the_running_chunk(served, monkeypatch):
    # The engine thread is held inside the prompt's first chunk while the client goes away;
    # the abort then comes at the next tick, from parked: no second chunk, no token.
    engine = served.engine
    chunk = hold_call(monkeypatch, engine.executor, "run")
    aborted = hold_call(monkeypatch, engine, "abort")  # seen when the route asks to abort
    aborted.open()
    before = len(served.trace())
    try:
        stream = OpenStream(served.url, "/v1/completions",
                            {"prompt": "z" * 200, "max_tokens": 4, "stream": True})
        chunk.wait_entered()
        assert [s["state"] for s in served.state()["sequences"]] == [PREFILLING]
        stream.drop()
        aborted.wait_entered()
    finally:
        chunk.open()
    served.wait_idle()
    events = served.trace(before)
    [done] = [e for e in events if e["trigger"] == CHUNK_DONE]
    [abort] = [e for e in events if e["trigger"] == ABORT]
    assert done["to"] == PARKED and abort["from"] == PARKED, events
    assert abort["tick"] == done["tick"] + 1, events


def test_finished_requests_are_not_aborted(served):
    before = len(served.trace())
    assert post(served.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status == 200
    served.wait_idle()
    triggers = [e["trigger"] for e in served.trace(before)]
    assert triggers[-1] == FINISH and ABORT not in triggers, triggers


# --- routing, limits and operator routes -------------------------------------------------------

@pytest.mark.parametrize("method,path,status", [("GET", "/nope", 404),
                                                ("GET", "/v1/completions", 405)])
def test_routing_errors_are_openai_json(served, method, path, status):
    reply = request(served.url, method, path)
    assert reply.status == status and reply.error()["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
def test_a_gzip_body_is_415_naming_the_coding(served, path):
    reply = post(served.url, path, raw=gzip.compress(b'{"prompt": "hi", "max_tokens": 1}'),
                 headers={"Content-Encoding": "gzip"})
    assert reply.status == 415 and "'gzip' is not supported" in reply.error()["message"]


def test_body_over_the_server_limit_is_413_json(served):
    reply = post(served.url, "/v1/completions", raw=b'{"prompt": "' + b"x" * 8000 + b'"}')
    assert reply.status == 413
    assert reply.error()["message"].endswith("the limit is 4096 bytes (--max-body-bytes)")


def test_a_body_declared_over_the_limit_with_expect_100_continue_is_413_before_it_is_sent(
        served):
    # The client waits for "100 Continue" before sending its body: a body declared over the
    # limit gets 413 at once (it was "100 Continue", then 413 once the whole body was sent).
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nExpect: 100-continue\r\nContent-Length: 9000"
                     b"\r\n\r\n")  # and no body
        data = b""
        while chunk := sock.recv(65536):  # to the connection's end: it closes
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    error = json.loads(body)["error"]
    assert error["message"].endswith("the limit is 4096 bytes (--max-body-bytes)")
    # Within the limit, "100 Continue" and then the body, as before.
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        body = b'{"prompt": "hi", "max_tokens": 1}'
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nExpect: 100-continue\r\nConnection: close\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200"), data[:200]


def test_a_stream_to_an_http_1_0_client_is_one_body_of_known_length(served):
    # HTTP/1.0 has no chunked encoding: the events come as one body with its length (a
    # streamed body of unknown length, chunked, put its chunk sizes into the client's text).
    host, port = served.url.removeprefix("http://").split(":")

    def exchange(version: bytes, body: bytes) -> tuple[bytes, bytes]:
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(b"POST /v1/completions " + version + b"\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nConnection: close\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            data = b""
            while chunk := sock.recv(65536):  # to the connection's end: it closes
                data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        return head.lower(), rest

    body = b'{"prompt": "hi", "max_tokens": 5, "stream": true, "stream_options": ' \
           b'{"include_usage": true}}'
    head, rest = exchange(b"HTTP/1.0", body)
    assert head.startswith(b"http/1.1 200") and b"transfer-encoding" not in head, head
    assert b"content-type: text/event-stream" in head
    assert b"content-length: %d" % len(rest) in head, head
    events = [line.removeprefix(b"data: ") for line in rest.split(b"\n\n") if line]
    assert events[-1] == b"[DONE]" and all(e.startswith(b"{") for e in events[:-1]), rest[:300]
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    # An HTTP/1.1 client still gets the events as they come, chunked.
    head, _ = exchange(b"HTTP/1.1", body)
    assert b"transfer-encoding: chunked" in head, head


def test_health(served, bundle):
    body = get(served.url, "/health").json()
    assert body == {"status": "ok", "model": bundle.name, "policy": served.engine.policy.name}


def test_metrics_parse(served):
    reply = get(served.url, "/metrics")
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/plain")
    names = {f.name for f in text_string_to_metric_families(reply.body.decode())}
    assert {"fairtick_requests_running", "fairtick_generation_tokens"} <= names


def test_debug_trace_and_state(served):
    post(served.url, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
    events = [json.loads(line) for line in
              get(served.url, "/debug/trace?since=0").body.decode().splitlines()]
    assert events[0]["kind"] == "arrival"
    assert [e for e in events if e["kind"] == "transition"][0]["trigger"] == ADMIT
    assert len(get(served.url, "/debug/trace?limit=1").body.decode().splitlines()) == 1
    state = served.state()
    assert state["policy"] == served.engine.policy.name and state["max_running"] == 1
    assert state["admission"] == {"queued": 0, "max_waiting": 1}
    assert state["kv"]["cached_tokens"] == 0
    assert state["kv"]["budget_tokens"] == served.engine.kv.tokens > 0
    assert state["memory"]["cached_sequences"] == 0 and state["memory"]["mlx_active_bytes"] > 0


@pytest.mark.parametrize("query", ["since=-1", "since=x", "limit=0", "limit=1.5",
                                   "state=preemted"])
def test_debug_trace_rejects_bad_queries(served, query):
    reply = get(served.url, f"/debug/trace?{query}")
    assert reply.status == 400 and reply.error()["param"] == query.split("=")[0]


def test_debug_trace_state_filter_names_the_lifecycles_states(served):
    # A misspelt state matched nothing and answered 200, as if nothing had happened.
    message = get(served.url, "/debug/trace?state=preemted").error()["message"]
    states = list(served.engine.lifecycle.role_of)
    assert "preempted" in states and all(name in message for name in states)
    assert get(served.url, "/debug/trace?state=preempted").status == 200
