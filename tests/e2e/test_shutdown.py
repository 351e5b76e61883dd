"""Graceful shutdown of the real server: on SIGTERM it stops admitting, lets in-flight requests
finish within the grace period, ends the rest with an in-band 503, and exits 0."""

from __future__ import annotations

import json
import signal
import threading
import time

from server.config import ServerConfig
from tests.e2e.conftest import start_server, stop_server
from tests.server.http_helpers import OpenStream, post

GRACE_S = ServerConfig().stop_grace_s
SLACK_S = 5.0  # process exit after the engine stopped: handlers flush, the loop closes


def test_sigterm_finishes_short_requests_aborts_long_ones_and_exits_0(tmp_path):
    server = start_server(tmp_path, "--parallel", "2", "--max-waiting", "2")
    try:
        long = OpenStream(server.url, "/v1/completions",
                          {"prompt": "long", "max_tokens": 30_000, "stream": True})
        long.read_event()
        short: dict = {}
        worker = threading.Thread(target=lambda: short.update(reply=post(
            server.url, "/v1/completions", {"prompt": "short", "max_tokens": 64})))
        worker.start()
        time.sleep(0.2)  # the short request is in flight
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)

        time.sleep(0.3)
        try:  # refused, or answered 503 while draining: never admitted
            late = post(server.url, "/v1/completions", {"prompt": "late", "max_tokens": 2},
                        timeout_s=5)
            assert late.status == 503 and late.error()["code"] == "engine_unavailable"
        except ConnectionError:
            pass

        worker.join(GRACE_S + SLACK_S)
        reply = short["reply"]
        assert reply.status == 200 and len(reply.json()["choices"][0]["text"]) == 64

        events = []
        while not events or events[-1] != "[DONE]":
            events.append(long.read_event())
            assert len(events) < 40_000
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_unavailable" and "shutting down" in error["message"]
        assert time.monotonic() - started < GRACE_S + SLACK_S

        assert server.process.wait(GRACE_S + SLACK_S) == 0, server.log()
        assert time.monotonic() - started < GRACE_S + SLACK_S
    finally:
        stop_server(server)
