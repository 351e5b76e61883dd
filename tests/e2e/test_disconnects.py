"""A client that disconnects while its sequence is waiting, parked or decoding has it aborted at
the next tick; afterwards the gauges, the running places, admission's queue, the KV in use, the
cached sequences and MLX's active memory are back to their idle baseline. (The requests opt
out of the prefix cache, which keeps aborted requests' KV by design.) (A disconnect while a
chunk runs, which needs the engine held inside that chunk: tests/server/test_routes.py.)"""

from __future__ import annotations

import pytest

from tests.e2e.test_ops import open_running, trace_events, wait_gauge
from tests.lifecycle_names import ABORT, DECODING, PARKED, WAITING
from tests.server.http_helpers import OpenStream, post


@pytest.fixture
def baseline(server) -> int:
    """MLX bytes in use while the shared server is idle (its weights)."""
    return int(server.wait_baseline(active_bytes=2**62)["memory"]["mlx_active_bytes"])


def aborts_of(server, before: int) -> list[dict]:
    return [e for e in trace_events(server)[before:] if e["trigger"] == ABORT]


def test_disconnect_while_decoding(server, baseline):
    before = len(trace_events(server))
    streams = open_running(server, 2)
    wait_gauge(server, "fairtick_requests_running", 2)
    streams[0].drop()
    wait_gauge(server, "fairtick_requests_running", 1)
    streams[1].drop()
    server.wait_baseline(baseline)
    assert [e["from"] for e in aborts_of(server, before)] == [DECODING, DECODING]
    reply = post(server.url, "/v1/completions", {"prompt": "after", "max_tokens": 2})
    assert reply.status == 200


def test_disconnect_while_waiting(server, baseline):
    before = len(trace_events(server))
    running = open_running(server, 2)
    waiting = OpenStream(server.url, "/v1/completions",
                         {"prompt": "queued", "max_tokens": 4, "stream": True,
                          "cache_prompt": False})
    wait_gauge(server, "fairtick_requests_waiting", 1)
    waiting.drop()
    wait_gauge(server, "fairtick_requests_waiting", 0)
    assert server.gauges()["fairtick_requests_running"] == 2
    assert server.state()["admission"]["queued"] == 0
    for stream in running:
        stream.drop()
    server.wait_baseline(baseline)
    assert sorted(e["from"] for e in aborts_of(server, before)) == sorted(
        [DECODING, DECODING, WAITING])


def test_disconnect_while_parked(server, baseline):
    running = open_running(server, 1)
    before = len(trace_events(server))
    parked = OpenStream(server.url, "/v1/completions",
                        {"prompt": "z" * 4000, "max_tokens": 2, "stream": True,
                         "cache_prompt": False})
    wait_gauge(server, "fairtick_requests_parked", 1)
    parked.drop()
    wait_gauge(server, "fairtick_requests_parked", 0)
    running[0].drop()
    server.wait_baseline(baseline)
    # Aborts are applied between ticks, never while a chunk runs: from parked, then decoding.
    assert [e["from"] for e in aborts_of(server, before)] == [PARKED, DECODING]
