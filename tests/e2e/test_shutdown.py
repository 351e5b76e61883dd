"""Graceful shutdown of the real server: on SIGTERM it stops admitting, lets in-flight requests
finish within the grace period, ends the rest with an in-band 503, and exits 0.

The test waits for events (a stream's first token, /health saying "draining"), never for time to
pass. The one time it measures is the grace period itself, from below: a server cannot abort
early by being slow."""

from __future__ import annotations

import json
import signal
import time

from server.config import ServerConfig
from tests.e2e.conftest import start_server, stop_server
from tests.server.http_helpers import OpenStream, get, post

GRACE_S = ServerConfig().stop_grace_s
# Tokens of the request that must finish within the grace period: enough that it is still
# running when draining begins (>= 2.3 ms a token), few enough to finish well within the grace.
SHORT_TOKENS = 160
EXIT_GUARD_S = GRACE_S + 60  # only a guard against a hang


def read_to_done(stream: OpenStream, limit: int) -> list[dict]:
    events = []
    while (data := stream.read_event()) != "[DONE]":
        events.append(json.loads(data))
        assert len(events) <= limit, "no [DONE]"
    return events


def wait_draining(url: str) -> None:
    """Until /health answers that the server is draining (fails after a guard time)."""
    deadline = time.monotonic() + 30
    while (health := get(url, "/health")).json().get("status") != "draining":
        assert time.monotonic() < deadline, f"never draining: {health.body!r}"
    assert health.status == 503


def test_sigterm_finishes_short_requests_aborts_long_ones_and_exits_0(tmp_path):
    server = start_server(tmp_path, "--max-running", "2", "--max-waiting", "2")
    try:
        long = OpenStream(server.url, "/v1/completions",
                          {"prompt": "long", "max_tokens": 30_000, "stream": True})
        long.read_event()
        short = OpenStream(server.url, "/v1/completions",
                           {"prompt": "short", "max_tokens": SHORT_TOKENS, "stream": True})
        first = json.loads(short.read_event())  # it runs: it holds the second slot
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)

        wait_draining(server.url)
        live = {s["request_id"] for s in get(server.url, "/debug/state").json()["sequences"]}
        assert {long.request_id, short.request_id} <= live, "both in flight as draining began"
        late = post(server.url, "/v1/completions", {"prompt": "late", "max_tokens": 2})
        assert late.status == 503 and late.error()["code"] == "engine_unavailable"

        events = [first, *read_to_done(short, SHORT_TOKENS + 2)]
        assert len("".join(e["choices"][0]["text"] for e in events)) == SHORT_TOKENS
        assert events[-1]["choices"][0]["finish_reason"] == "length"

        events = read_to_done(long, 40_000)
        error = events[-1]["error"]
        assert error["code"] == "engine_unavailable" and "shutting down" in error["message"]
        assert time.monotonic() - signalled >= GRACE_S, "aborted before the grace period ended"

        assert server.process.wait(EXIT_GUARD_S) == 0, server.log()
    finally:
        stop_server(server)
