"""The socket `fairtick serve` binds before its model loads (server.listener)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from server.listener import bind_listener

# TEST-NET-1 (RFC 5737): documentation only, never an address of this machine.
NOT_HERE = "192.0.2.1"


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another socket listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


def test_it_binds_the_address_asked_and_listens_only_when_told(taken_port):
    with bind_listener("127.0.0.1", 0) as sock:
        host, port = sock.getsockname()
        assert host == "127.0.0.1" and port not in (0, taken_port)
        # Not listening while the model loads: a client is refused, not queued.
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 0
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((host, port), timeout=5)
        sock.listen(16)  # what asyncio's server does when Sanic serves
        with socket.create_connection((host, port), timeout=5):
            pass


def test_a_port_in_use_names_the_port_the_address_and_the_reason(taken_port):
    with pytest.raises(ValueError) as info:
        bind_listener("127.0.0.1", taken_port)
    message = str(info.value)
    assert message.startswith(f"--port {taken_port}: cannot listen on 127.0.0.1:{taken_port}: "
                              "Address already in use"), message
    assert "\n" not in message


@pytest.mark.parametrize("host", ["999.1.1.1", "example.invalid", NOT_HERE])
def test_a_host_it_cannot_listen_on_names_the_host_and_the_reason(host):
    with pytest.raises(ValueError) as info:
        bind_listener(host, 8000)
    message, prefix = str(info.value), f"--host {host}: cannot listen on {host}:8000: "
    assert message.startswith(prefix), message
    reason = message.removeprefix(prefix)
    assert reason and "\n" not in message
    if host == NOT_HERE:
        assert "Cannot assign requested address" in reason and "not an address of this " \
            "machine" in reason, reason
