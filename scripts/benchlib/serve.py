"""Start and stop `fairtick serve` (or mlx_lm.server) on 127.0.0.1 for a benchmark arm."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchlib.attribution import REPO
from benchlib.client import get_json

SERVE = [sys.executable, "-c", "import sys; from server.cli import main; sys.exit(main())",
         "serve"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]


def start_server(flags: list[str], log_path: Path, timeout_s: float = 120.0) -> Server:
    """`fairtick serve FLAGS` on a free port; returns once /health answers (RuntimeError with
    the log's tail if it exits or does not answer in time)."""
    port = free_port()
    cmd = [*SERVE, "--host", "127.0.0.1", "--port", str(port), *flags]
    return start_process(cmd, port, log_path, timeout_s, name=f"fairtick serve {' '.join(flags)}")


def start_mlx_lm_server(model_dir: Path, log_path: Path, timeout_s: float = 120.0,
                        env: dict[str, str] | None = None) -> Server:
    """`python -m mlx_lm.server --model DIR` (its defaults otherwise) on a free port."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port)]
    return start_process(cmd, port, log_path, timeout_s, name="mlx_lm.server", env=env)


def start_process(cmd: list[str], port: int, log_path: Path, timeout_s: float, name: str,
                  env: dict[str, str] | None = None) -> Server:
    """Start the HTTP server `cmd` listening on `port`; returns once its /health answers."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                   env={**(env or os.environ), "PYTHONUNBUFFERED": "1"})
    server = Server(f"http://127.0.0.1:{port}", process, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{server.log_tail()}")
        try:
            get_json(server.url, "/health", timeout_s=2)
            return server
        except (OSError, ValueError, RuntimeError):
            time.sleep(0.2)
    stop_server(server)
    raise RuntimeError(f"{name} did not answer within {timeout_s:.0f} s:\n{server.log_tail()}")


def stop_server(server: Server, timeout_s: float = 30.0) -> int:
    """SIGTERM, then SIGKILL if it does not stop in time; its exit status."""
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(timeout_s)
    return int(server.process.returncode)
