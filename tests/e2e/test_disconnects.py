"""A client that disconnects, in every lifecycle state (waiting, parked, prefilling, decoding), has
its sequence aborted at the next tick; afterwards the gauges, the slots, admission's queue and
KV budget, the cached sequences and MLX's active memory are back to their idle baseline."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.e2e.conftest import LiveServer, start_server, stop_server
from tests.e2e.test_ops import open_running, trace_events, wait_gauge
from tests.server.http_helpers import OpenStream, post


@pytest.fixture
def baseline(server) -> int:
    """MLX bytes in use while the shared server is idle (its weights)."""
    return int(server.wait_baseline(active_bytes=2**62)["memory"]["mlx_active_bytes"])


def aborts_of(server, before: int) -> list[dict]:
    return [e for e in trace_events(server)[before:] if e["trigger"] == "abort"]


def test_disconnect_while_decoding(server, baseline):
    before = len(trace_events(server))
    streams = open_running(server, 2)
    wait_gauge(server, "fairtick_requests_running", 2)
    streams[0].drop()
    wait_gauge(server, "fairtick_requests_running", 1)
    streams[1].drop()
    server.wait_baseline(baseline)
    assert [e["from"] for e in aborts_of(server, before)] == ["decoding", "decoding"]
    reply = post(server.url, "/v1/completions", {"prompt": "after", "max_tokens": 2})
    assert reply.status == 200


def test_disconnect_while_waiting(server, baseline):
    before = len(trace_events(server))
    running = open_running(server, 2)
    waiting = OpenStream(server.url, "/v1/completions",
                         {"prompt": "queued", "max_tokens": 4, "stream": True})
    wait_gauge(server, "fairtick_requests_waiting", 1)
    waiting.drop()
    wait_gauge(server, "fairtick_requests_waiting", 0)
    assert server.gauges()["fairtick_requests_running"] == 2
    assert server.state()["admission"]["queued"] == 0
    for stream in running:
        stream.drop()
    server.wait_baseline(baseline)
    assert sorted(e["from"] for e in aborts_of(server, before)) == [
        "decoding", "decoding", "waiting"]


def test_disconnect_while_parked(server, baseline):
    running = open_running(server, 1)
    before = len(trace_events(server))
    parked = OpenStream(server.url, "/v1/completions",
                        {"prompt": "z" * 4000, "max_tokens": 2, "stream": True})
    wait_gauge(server, "fairtick_requests_parked", 1)
    parked.drop()
    wait_gauge(server, "fairtick_requests_parked", 0)
    running[0].drop()
    server.wait_baseline(baseline)
    aborts = aborts_of(server, before)
    assert any(e["from"] in ("parked_prefill", "prefilling") for e in aborts), aborts


@pytest.fixture(scope="module")
def big_chunks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One slot and 1024-token chunks: a chunk runs long enough to be seen `prefilling`."""
    server = start_server(tmp_path_factory.mktemp("chunks"), "--parallel", "1",
                          "--prefill-chunk-size", "1024")
    yield server
    assert stop_server(server) == 0


def test_disconnect_while_prefilling_stops_after_the_running_chunk(big_chunks):
    server = big_chunks
    server.wait_baseline(active_bytes=2**62)
    post(server.url, "/v1/completions", {"prompt": "warm", "max_tokens": 2})
    baseline = server.wait_baseline(2**62)["memory"]["mlx_active_bytes"]
    chunks_before = server.gauges()["fairtick_prefill_chunks_total"]
    tokens_before = server.gauges()["fairtick_generation_tokens_total"]
    before = len(trace_events(server))
    stream = OpenStream(server.url, "/v1/completions",
                        {"prompt": [65] * 3000, "max_tokens": 4, "stream": True})
    assert stream.response.status == 200
    server_state = {}
    for _ in range(500):  # every 10 ms, up to 5 s
        server_state = server.state()
        if any(s["state"] == "prefilling" for s in server_state["sequences"]):
            break
        time.sleep(0.01)
    else:
        raise AssertionError(f"never saw the first chunk running: {server_state}")
    stream.drop()
    server.wait_baseline(baseline)
    events = trace_events(server)[before:]
    done = [e for e in events if e["trigger"] == "chunk_done"]
    [abort] = [e for e in events if e["trigger"] == "abort"]
    assert len(done) == 1 and done[0]["to"] == "parked_prefill", events
    assert abort["from"] == "parked_prefill" and abort["tick"] == done[0]["tick"] + 1, events
    gauges = server.gauges()
    assert gauges["fairtick_prefill_chunks_total"] == chunks_before + 1, "no chunk after it"
    assert gauges["fairtick_generation_tokens_total"] == tokens_before
