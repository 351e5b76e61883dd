"""scripts/bench/starvation_probe.sh: rows of counters, and no server left behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

from tests.scripts.conftest import REPO
from tests.server.http_helpers import free_port

PROBE = REPO / "scripts" / "bench" / "starvation_probe.sh"
SMALL = {"CHUNK": "16", "PROMPT_TOKENS": "300", "STREAMS": "2", "STREAM_TOKENS": "4000",
         "ADMIT_AFTER_S": "1", "INTERVAL_S": "1"}


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_rows_and_cleanup():
    port = free_port()
    env = {**os.environ, **SMALL, "SAMPLES": "2", "PORT": str(port)}
    done = subprocess.run(["bash", str(PROBE), "mixed_step"], env=env, capture_output=True,
                          text=True, timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = done.stdout.splitlines()[2:]
    assert len(rows) == 2, done.stdout
    elapsed, chunks, grants, mixed, decode, first = rows[-1].split()
    assert int(chunks) >= 19 and int(mixed) >= 1 and int(decode) > 0 and first == "yes", rows
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
