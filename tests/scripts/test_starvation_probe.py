"""scripts/bench/starvation_probe.sh: rows of counters, and no server left behind.

The probe samples on a clock (its purpose); how far the prompt got by each sample depends on the
machine's speed, so the test checks what holds at any speed: each row is read from the server's
counters (integers, never missing), counters never go back, the counters' own relations hold, and
a first token once seen stays seen. Whether a policy starves the prompt is tested on events in
tests/e2e/test_starvation.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from tests.scripts.conftest import REPO
from tests.server.http_helpers import free_port

PROBE = REPO / "scripts" / "bench" / "starvation_probe.sh"
# PYTHON: the interpreter running the tests (the probe's default is the checkout's .venv).
SMALL = {"PYTHON": sys.executable, "CHUNK": "16", "PROMPT_TOKENS": "300", "STREAMS": "2",
         "STREAM_TOKENS": "4000", "ADMIT_AFTER_S": "1", "INTERVAL_S": "1"}


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_rows_and_cleanup():
    port = free_port()
    env = {**os.environ, **SMALL, "SAMPLES": "2", "PORT": str(port)}
    done = subprocess.run(["bash", str(PROBE), "mixed_step"], env=env, capture_output=True,
                          text=True, timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split() for line in done.stdout.splitlines()[2:]]
    assert len(rows) == 2 and all(len(row) == 6 for row in rows), done.stdout
    counters = [[int(value) for value in row[1:5]] for row in rows]  # '-': a missing counter
    assert all(a <= b for a, b in zip(counters[0], counters[1], strict=True)), rows
    for chunks, grants, mixed, decode in counters:
        # A grant is a chunk granted beside decoding streams; a mixed step is a decode step.
        assert grants <= chunks and mixed <= decode, rows
    firsts = [row[5] for row in rows]
    assert firsts in (["no", "no"], ["no", "yes"], ["yes", "yes"]), rows
    assert float(rows[0][0]) < float(rows[1][0]), rows
    assert not port_open(port), "the probe left its server running"


def test_sigterm_stops_the_server():
    port = free_port()
    env = {**os.environ, **SMALL, "SAMPLES": "50", "PORT": str(port)}
    probe = subprocess.Popen(["bash", str(PROBE), "baseline"], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert probe.stdout is not None
        probe.stdout.readline()  # the header: the server is up, the streams started
        assert port_open(port)
        probe.send_signal(signal.SIGTERM)
        assert probe.wait(30) == 143
    finally:
        if probe.poll() is None:
            probe.kill()
    deadline = time.monotonic() + 10
    while port_open(port) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not port_open(port), "SIGTERM left the probe's server running"
