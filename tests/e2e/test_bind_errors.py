"""`fairtick serve` on an address it cannot listen on: exit status 2 and one line naming the flag
at fault, the address and the OS's reason, before the model loads; never a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

FAIRTICK = Path(sys.executable).with_name("fairtick")  # the console script of this venv
REPO = Path(__file__).resolve().parents[2]
# TEST-NET-1 (RFC 5737): documentation only, never an address of this machine.
NOT_HERE = "192.0.2.1"


def serve(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(FAIRTICK), "serve", *flags], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def assert_refused(done: subprocess.CompletedProcess[str], line_start: str) -> str:
    """The one line on stderr, after checking the exit status and that nothing else ran."""
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "Traceback" not in output and "loading" not in output, output
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fairtick serve: {line_start}"), output
    return lines[0]


def test_a_port_in_use_exits_2_naming_the_port():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = serve("--host", "127.0.0.1", "--port", str(port))
    line = assert_refused(done, f"--port {port}: cannot listen on 127.0.0.1:{port}: ")
    assert "Address already in use" in line


@pytest.mark.parametrize("host,reason", [("999.1.1.1", ""), ("example.invalid", ""),
                                         (NOT_HERE, "Cannot assign requested address")])
def test_a_host_it_cannot_listen_on_exits_2_naming_the_host(host, reason):
    line = assert_refused(serve("--host", host, "--port", "8000"),
                          f"--host {host}: cannot listen on {host}:8000: ")
    assert reason in line
