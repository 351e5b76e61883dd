"""The real server, started as `fairtick serve` in a subprocess on 127.0.0.1, with the built-in
model; shared by the whole e2e session and stopped with SIGTERM at the end (which must exit 0).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.http_helpers import free_port, get

REPO = Path(__file__).resolve().parents[2]
# Small enough for 2 CPU cores: 2 slots, a queue of 2, 32-token chunks.
SERVE_FLAGS = ("--parallel", "2", "--max-waiting", "2", "--prefill-chunk-size", "32")
START_TIMEOUT_S = 120.0


@dataclass
class LiveServer:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def gauges(self) -> dict[str, float]:
        """Unlabelled sample values from /metrics."""
        text = get(self.url, "/metrics").body.decode()
        return {s.name: s.value for f in text_string_to_metric_families(text)
                for s in f.samples if not s.labels}

    def state(self) -> dict[str, Any]:
        return dict(get(self.url, "/debug/state").json())

    def wait_idle(self, timeout_s: float = 15.0) -> None:
        """Until no sequence runs, waits or is parked (fails the test otherwise)."""
        names = ("fairtick_requests_running", "fairtick_requests_waiting",
                 "fairtick_requests_parked")
        deadline = time.monotonic() + timeout_s
        while True:
            gauges = self.gauges()
            if all(gauges.get(n) == 0 for n in names):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle: { {n: gauges.get(n) for n in names} }")
            time.sleep(0.05)

    def wait_baseline(self, active_bytes: int, timeout_s: float = 15.0) -> dict[str, Any]:
        """Until the gauges are 0, no sequence is live, admission holds no place and no KV token,
        no sequence holds a cache and MLX holds no more than `active_bytes`; the state then."""
        self.wait_idle(timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.state()
            admission, memory = state["admission"], state["memory"]
            if (not state["sequences"] and admission["queued"] == 0
                    and admission["kv_tokens_reserved"] == 0 and memory["cached_sequences"] == 0
                    and memory["mlx_active_bytes"] <= active_bytes):
                return state
            if time.monotonic() > deadline:
                raise AssertionError(f"not back to the baseline ({active_bytes} bytes): {state}")
            time.sleep(0.05)


def start_server(tmp_dir: Path, *flags: str) -> LiveServer:
    """`fairtick serve` on a free port; returns once /health answers 200."""
    port = free_port()
    log_path = tmp_dir / f"serve-{port}.log"
    cmd = [sys.executable, "-c", "import sys; from server.cli import main; sys.exit(main())",
           "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = LiveServer(f"http://127.0.0.1:{port}", process, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"fairtick serve exited with {process.returncode}:\n{server.log()}")
        try:
            if get(server.url, "/health", timeout_s=2).status == 200:
                return server
        except OSError:
            pass
        time.sleep(0.2)
    stop_server(server)
    raise RuntimeError(f"fairtick serve did not become healthy:\n{server.log()}")


def stop_server(server: LiveServer, timeout_s: float = 30.0) -> int:
    """SIGTERM, then the exit status (killing it if it does not stop in time)."""
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
    return int(server.process.returncode)


@pytest.fixture(scope="session")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = start_server(tmp_path_factory.mktemp("e2e"), *SERVE_FLAGS)
    yield server
    status = stop_server(server)
    assert status == 0, f"SIGTERM must stop the server cleanly (exit {status}):\n{server.log()}"


@pytest.fixture
def server(live_server: LiveServer) -> Iterator[LiveServer]:
    """The shared server, idle before and after each test."""
    live_server.wait_idle()
    yield live_server
    live_server.wait_idle()


@pytest.fixture(scope="session")
def model_name(live_server: LiveServer) -> str:
    return str(get(live_server.url, "/v1/models").json()["data"][0]["id"])
