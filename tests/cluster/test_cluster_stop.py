"""`fairtick cluster` stopped by SIGTERM: a stream in flight runs on through the grace period
and ends as a stream ends, and the process exits 0. (Ray's start put its own SIGTERM handler in
the process, which exited at once, and stopping Serve killed its proxy first: the stream was cut
mid-event with no error and no [DONE].)"""

from __future__ import annotations

import http.client
import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster.conftest import RAY_MISSING
from tests.server.http_helpers import free_port

FAIRTICK = Path(sys.executable).with_name("fairtick")
REPO = Path(__file__).resolve().parents[2]
START_S = 240  # a Ray start costs 10-60 s on a shared 2-core machine


def wait_healthy(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, "fairtick cluster exited while starting"
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(f"fairtick cluster did not answer /health within {START_S} s")


def test_sigterm_lets_a_stream_finish_within_the_grace_period(tmp_path):
    if importlib.util.find_spec("ray") is None:
        pytest.skip(RAY_MISSING)
    port = free_port()
    log = (tmp_path / "cluster.log").open("wb")
    proc = subprocess.Popen(
        [str(FAIRTICK), "cluster", "--replicas", "1", "--num-cpus", "2", "--port", str(port),
         "--max-kv-tokens", "20000", "--stop-grace-s", "30"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(port, proc)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/v1/completions", json.dumps(
            {"prompt": "term", "max_tokens": 400, "ignore_eos": True, "stream": True}),
            {"Content-Type": "application/json"})
        reply = conn.getresponse()
        assert reply.status == 200
        events: list[bytes] = []
        while events[-1:] != [b"data: [DONE]"] and (line := reply.fp.readline()):
            if line.startswith(b"data:"):
                events.append(line.strip())
                if len(events) == 20:
                    proc.send_signal(signal.SIGTERM)
        conn.close()  # the proxy lives, within the grace, while a client is connected
        assert events[-1] == b"data: [DONE]", (len(events), events[-2:])
        choices = [json.loads(e[5:])["choices"][0] for e in events[:-1]]
        # Every token (the built-in model's are one character each), then the finish.
        assert len("".join(c["text"] for c in choices)) == 400
        assert choices[-1]["finish_reason"] == "length"
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert b"stopping the cluster" in (tmp_path / "cluster.log").read_bytes()
