"""The real server, started as `fairtick serve` in a subprocess on 127.0.0.1, with the built-in
model; shared by the whole e2e session and stopped with SIGTERM at the end (which must exit 0).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from benchlib.serve import Server
from benchlib.serve import start_server as start_bench_server
from benchlib.serve import stop_server as stop_bench_server
from prometheus_client.parser import text_string_to_metric_families

from tests.server.http_helpers import get

REPO = Path(__file__).resolve().parents[2]

_server_numbers = itertools.count()
# Small enough for 2 CPU cores: 2 running, a queue of 2, 32-token chunks.
SERVE_FLAGS = ("--max-running", "2", "--max-waiting", "2", "--prefill-chunk-size", "32")
START_TIMEOUT_S = 120.0


@dataclass
class LiveServer(Server):
    """A running `fairtick serve`, with what the tests read from it."""

    def log(self) -> str:
        return self.log_tail(5000)

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
                    and state["kv"]["cached_tokens"] == 0 and memory["cached_sequences"] == 0
                    and memory["mlx_active_bytes"] <= active_bytes):
                return state
            if time.monotonic() > deadline:
                raise AssertionError(f"not back to the baseline ({active_bytes} bytes): {state}")
            time.sleep(0.05)


def start_server(tmp_dir: Path, *flags: str) -> LiveServer:
    """`fairtick serve` on a free port (benchlib's launcher); returns once /health answers."""
    log_path = tmp_dir / f"serve-{next(_server_numbers)}.log"
    server = start_bench_server(list(flags), log_path, timeout_s=START_TIMEOUT_S)
    return LiveServer(server.url, server.process, server.log_path)


def stop_server(server: LiveServer, timeout_s: float = 30.0) -> int:
    """SIGTERM, then the exit status (killing it if it does not stop in time)."""
    return stop_bench_server(server, timeout_s)


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


@pytest.fixture(scope="session")
def builtin() -> Any:
    """The built-in model the server serves (it is given no --model), loaded here too: its
    name and its real tokenizer are what the tests expect."""
    from runtime.model import load_model

    return load_model(None)
