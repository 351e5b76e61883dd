"""Every outcome of a request shows in /metrics and in the log, through the real server over the
real engine: finished by finish_reason, refused by status and reason, aborted by cause.

Each test reads the outcome series before and after it provokes one outcome for real (a bad
field, a full queue, a dropped stream, a fault injected into one request's prefill, a shutdown)
and asserts that exactly the expected series moved, by one.
"""

from __future__ import annotations

import logging
import time

import pytest
from prometheus_client import generate_latest

from tests.server.http_helpers import OpenStream, post, request
from tests.server.outcome_helpers import (
    ABORTED,
    FINISHED,
    REFUSED,
    parse_samples,
    scrape,
    series,
    wait_line,
    wait_moves,
)
from tests.server.serving import POISON, poison_prompts, serve

LONG = 20_000  # max_tokens of a stream that a test cuts off long before it ends


@pytest.fixture(scope="module")
def one_slot(bundle):
    """One running place and a queue of one: a held stream makes the next request wait and the
    one after get 429."""
    with serve(bundle, max_running=1, max_waiting=1) as served:
        yield served


@pytest.fixture
def served(one_slot, caplog):
    caplog.set_level(logging.INFO, logger="fairtick.requests")
    one_slot.wait_idle()
    yield one_slot
    one_slot.wait_idle()


def hold(url: str, prompt: str = "hold") -> OpenStream:
    """A stream that has its first token: it holds the running place until dropped."""
    stream = OpenStream(url, "/v1/completions",
                        {"prompt": prompt, "max_tokens": LONG, "stream": True})
    stream.read_event()
    return stream


def refused(reply) -> tuple:
    """The refusal series a reply must move: its status, and its error's code (its type when it
    has no code), as docs/operations.md defines the reason."""
    error = reply.error()
    return series(REFUSED, status=str(reply.status), reason=error["code"] or error["type"])


# --- finished ------------------------------------------------------------------------------------

def test_a_finished_request_counts_its_reason_and_its_latencies(served):
    before = scrape(served.url)
    reply = post(served.url, "/v1/completions", {"prompt": "done", "max_tokens": 2})
    assert reply.json()["choices"][0]["finish_reason"] == "length"
    after = wait_moves(served.url, before, {series(FINISHED, finish_reason="length"): 1})
    for histogram in ("fairtick_e2e_request_latency_seconds",
                      "fairtick_request_queue_time_seconds",
                      "fairtick_time_to_first_token_seconds"):
        count = series(f"{histogram}_count")
        assert after[count] - before[count] == 1, histogram


def test_a_stop_string_counts_as_stop(served):
    before = scrape(served.url)
    text = post(served.url, "/v1/completions",
                {"prompt": "stopper", "max_tokens": 8}).json()["choices"][0]["text"]
    before = wait_moves(served.url, before, {series(FINISHED, finish_reason="length"): 1})
    reply = post(served.url, "/v1/completions",
                 {"prompt": "stopper", "max_tokens": 8, "stop": [text[-2:]]})
    assert reply.json()["choices"][0]["finish_reason"] == "stop"
    wait_moves(served.url, before, {series(FINISHED, finish_reason="stop"): 1})


# --- one outcome per request, whatever its choices and prompts ----------------------------------

@pytest.fixture(scope="module")
def roomy(bundle):
    """Room for a batch of prompts and their choices."""
    with serve(bundle, max_running=4, max_waiting=4) as served:
        yield served


@pytest.mark.parametrize("body", [{"prompt": "three", "n": 3},
                                  {"prompt": ["a", "b"], "n": 2},
                                  {"prompt": ["a", "b", "c"]}])
def test_choices_and_batch_prompts_are_one_finished_request(roomy, caplog, body):
    caplog.set_level(logging.INFO, logger="fairtick.requests")
    roomy.wait_idle()
    before = scrape(roomy.url)
    reply = post(roomy.url, "/v1/completions", {**body, "max_tokens": 3}).json()
    after = wait_moves(roomy.url, before, {series(FINISHED, finish_reason="length"): 1})
    e2e = series("fairtick_e2e_request_latency_seconds_count")
    assert after[e2e] - before[e2e] == 1
    line = wait_line(caplog, reply["id"])  # under the id the client saw: one line
    assert int(line["prompt_tokens"]) == reply["usage"]["prompt_tokens"]
    assert int(line["completion_tokens"]) == reply["usage"]["completion_tokens"] == \
        3 * len(reply["choices"])
    roomy.wait_idle()


def test_a_dropped_chat_stream_of_n_choices_is_one_abort(roomy, caplog):
    caplog.set_level(logging.INFO, logger="fairtick.requests")
    roomy.wait_idle()
    messages = [{"role": "user", "content": "hi"}]
    prompt_tokens = post(roomy.url, "/v1/chat/completions",
                         {"messages": messages, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    before = scrape(roomy.url)
    stream = OpenStream(roomy.url, "/v1/chat/completions",
                        {"messages": messages, "n": 3, "max_tokens": LONG, "stream": True})
    for _ in range(3 + 3):  # the role chunks of the three choices, then tokens
        stream.read_event()
    stream.drop()
    wait_moves(roomy.url, before, {series(ABORTED, cause="client_disconnect"): 1})
    line = wait_line(caplog, stream.request_id)
    assert (line["outcome"], line["cause"]) == ("aborted", "client_disconnect")
    assert int(line["prompt_tokens"]) == prompt_tokens, "the prompt once, not once per choice"
    roomy.wait_idle()


def test_a_batch_refused_at_its_second_prompt_is_only_a_refusal(bundle, caplog):
    caplog.set_level(logging.INFO, logger="fairtick.requests")
    with serve(bundle, max_running=1, max_waiting=2) as served:
        holder = hold(served.url)
        queued = OpenStream(served.url, "/v1/completions",
                            {"prompt": "queued", "max_tokens": 3, "stream": True})
        served.wait_for(lambda s: s["admission"]["queued"] == 1)
        before = scrape(served.url)
        reply = post(served.url, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2})
        assert reply.status == 429, reply.body
        after = wait_moves(served.url, before, {refused(reply): 1})
        served.wait_for(lambda s: s["admission"]["queued"] == 1)  # its first prompt aborted
        holder.drop()
        while queued.read_event() != "[DONE]":
            pass
        wait_moves(served.url, after, {series(ABORTED, cause="client_disconnect"): 1,
                                       series(FINISHED, finish_reason="length"): 1})
        served.wait_idle()
    ids = {holder.request_id, queued.request_id}
    logged = [r.getMessage() for r in caplog.records if r.name == "fairtick.requests"]
    assert len(logged) == 2 and all(m.split()[1] in ids for m in logged), logged


# --- refused -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("method", "path", "body", "status"), [
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400),
    ("POST", "/v1/chat/completions", {"messages": []}, 400),
    ("GET", "/nope", None, 404),
    ("GET", "/v1/completions", None, 405),
    ("POST", "/v1/completions", b'{"prompt": "' + b"x" * 8000 + b'"}', 413),
])
def test_each_refusal_counts_its_status_and_reason(served, method, path, body, status):
    before = scrape(served.url)
    raw = body if isinstance(body, bytes) else None
    reply = request(served.url, method, path, None if raw else body, raw=raw)
    assert reply.status == status, reply.body
    wait_moves(served.url, before, {refused(reply): 1})


def test_a_full_queue_counts_429_then_the_queued_and_dropped_requests(served):
    holder = hold(served.url)
    queued = OpenStream(served.url, "/v1/completions",
                        {"prompt": "queued", "max_tokens": 3, "stream": True})
    served.wait_for(lambda s: s["admission"]["queued"] == 1)
    before = scrape(served.url)
    reply = post(served.url, "/v1/completions", {"prompt": "one too many"})
    assert reply.status == 429
    assert refused(reply) == series(REFUSED, status="429", reason="server_busy")
    after = wait_moves(served.url, before, {refused(reply): 1})
    holder.drop()
    while queued.read_event() != "[DONE]":
        pass
    wait_moves(served.url, after, {series(ABORTED, cause="client_disconnect"): 1,
                                   series(FINISHED, finish_reason="length"): 1})


def test_a_missing_api_key_counts_401(bundle):
    with serve(bundle, server={"api_key": "sesame"}) as served:
        before = scrape(served.url)
        reply = post(served.url, "/v1/completions", {"prompt": "hi"})
        assert reply.status == 401
        wait_moves(served.url, before,
                   {series(REFUSED, status="401", reason="invalid_api_key"): 1})


def test_a_stopped_engine_counts_503_engine_unavailable(bundle):
    with serve(bundle) as served:
        served.engine.stop(grace_s=0)
        before = scrape(served.url)
        reply = post(served.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert reply.status == 503
        wait_moves(served.url, before,
                   {series(REFUSED, status="503", reason="engine_unavailable"): 1})


# --- aborted -------------------------------------------------------------------------------------

def test_a_dropped_stream_counts_a_client_disconnect_and_logs_it(served, caplog):
    before = scrape(served.url)
    stream = hold(served.url)
    stream.drop()
    wait_moves(served.url, before, {series(ABORTED, cause="client_disconnect"): 1})
    line = wait_line(caplog, stream.request_id)
    assert (line["outcome"], line["cause"], line["finish_reason"]) == \
        ("aborted", "client_disconnect", "abort")
    assert int(line["completion_tokens"]) >= 1 and line["ttft_s"] != "-"


def test_a_failed_generation_counts_an_error_abort_not_a_refusal(bundle, monkeypatch):
    with serve(bundle, max_running=2, max_waiting=2) as served:
        poison_prompts(served.engine, monkeypatch, "prefill")
        before = scrape(served.url)
        reply = post(served.url, "/v1/completions", {"prompt": POISON.decode(), "max_tokens": 4})
        assert reply.status == 500 and reply.error()["code"] == "generation_error"
        wait_moves(served.url, before, {series(ABORTED, cause="error"): 1})


def test_a_shutdown_counts_and_logs_server_shutdown_aborts(bundle, caplog):
    caplog.set_level(logging.INFO, logger="fairtick.requests")
    with serve(bundle) as served:
        stream = hold(served.url)
        engine = served.engine
    # Stopped with no grace: the held stream was aborted by the shutdown. The registry outlives
    # the server; its text is what /metrics served.
    stream.drop()
    samples = parse_samples(generate_latest(engine.registry).decode())
    assert samples[series(ABORTED, cause="server_shutdown")] == 1
    assert samples[series(ABORTED, cause="client_disconnect")] == 0
    line = wait_line(caplog, stream.request_id)
    assert (line["outcome"], line["cause"]) == ("aborted", "server_shutdown")


# --- the log line and the KV gauges --------------------------------------------------------------

def test_each_finished_request_logs_one_line_with_its_numbers(served, caplog):
    reply = post(served.url, "/v1/completions", {"prompt": "log me", "max_tokens": 5}).json()
    line = wait_line(caplog, reply["id"])
    assert line["outcome"] == "finished" and "cause" not in line
    assert line["finish_reason"] == reply["choices"][0]["finish_reason"] == "length"
    assert int(line["prompt_tokens"]) == reply["usage"]["prompt_tokens"]
    assert int(line["completion_tokens"]) == reply["usage"]["completion_tokens"] == 5
    queue_s, ttft_s, e2e_s = (float(line[k]) for k in ("queue_s", "ttft_s", "e2e_s"))
    assert 0 <= queue_s <= ttft_s <= e2e_s
    assert line["preemptions"] == "0"


def test_a_preempted_request_logs_its_preemptions(bundle, caplog):
    # A KV budget far below what the streams need together: the default policy drops the
    # youngest and re-prefills it later; each one's line counts its own preemptions.
    caplog.set_level(logging.INFO, logger="fairtick.requests")
    lengths = [(30, 60), (50, 40), (20, 90), (70, 30), (40, 70), (25, 50)]
    with serve(bundle, max_running=8, max_waiting=8, max_kv_tokens=160) as served:
        streams = [OpenStream(served.url, "/v1/completions",
                              {"prompt": chr(65 + i) * n, "max_tokens": m, "stream": True})
                   for i, (n, m) in enumerate(lengths)]
        for stream in streams:
            while stream.read_event() != "[DONE]":
                pass
        lines = [wait_line(caplog, stream.request_id) for stream in streams]
        dropped = scrape(served.url)[series("fairtick_preemptions_total", kind="drop")]
    assert dropped > 0, "the budget was never short: not a test of preemption"
    assert sum(int(line["preemptions"]) for line in lines) == dropped
    assert {line["finish_reason"] for line in lines} == {"length"}


def wait_sample(url: str, key: tuple, holds, timeout_s: float = 15.0) -> float:
    """The sample's value once `holds(value)` (gauges are set at the end of a tick)."""
    deadline = time.monotonic() + timeout_s
    while not holds(value := scrape(url)[key]):
        assert time.monotonic() < deadline, f"{key} stayed at {value}"
        time.sleep(0.02)
    return value


def test_the_kv_gauges_show_the_budget_and_the_tokens_held(served):
    budget = series("fairtick_kv_budget_tokens")
    used = series("fairtick_kv_used_tokens")
    assert scrape(served.url)[budget] == served.state()["kv"]["budget_tokens"]
    stream = hold(served.url)
    wait_sample(served.url, used, lambda tokens: tokens > 0)
    stream.drop()
    wait_sample(served.url, used, lambda tokens: tokens == 0)


def test_a_refused_request_logs_no_request_line(served, caplog):
    # It never reached the engine: its one trace is the refusal counter (and the access log).
    assert post(served.url, "/v1/completions", {"prompt": "hi", "max_tokens": "many"}).status \
        == 400
    ok = post(served.url, "/v1/completions", {"prompt": "hi", "max_tokens": 1}).json()
    wait_line(caplog, ok["id"])
    lines = [r.getMessage() for r in caplog.records if r.name == "fairtick.requests"]
    assert len(lines) == 1 and ok["id"] in lines[0], lines
