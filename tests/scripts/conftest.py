"""The benchmark scripts' tests: one real `fairtick serve` (mixed_step, 5 slots, 16-token
chunks) per module, started like the e2e tests start theirs; `benchlib` importable."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import LiveServer, start_server, stop_server

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"

SERVE_FLAGS = ("--policy", "mixed_step", "--parallel", "5", "--prefill-chunk-size", "16")
# A layout small enough for 2 cores: 200-token prompt (13 chunks), half a second of quiet.
SMALL = ["--prompt-tokens", "200", "--settle-s", "0.5", "--stream-tokens", "3000",
         "--timeout-s", "60"]


@pytest.fixture(scope="module")
def mixed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = start_server(tmp_path_factory.mktemp("scripts"), *SERVE_FLAGS)
    yield server
    stop_server(server)


def run_script(name: str, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """scripts/NAME ARGS with this interpreter, output captured."""
    return subprocess.run([sys.executable, str(SCRIPTS / name), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s)


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR; fails the test if `path` is not a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", data[:16]
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
