"""The socket of `fairtick serve`, bound before the model loads.

Bound here and handed to Sanic, so that an address the server cannot listen on (a port in use,
a host that does not resolve or is not this machine's) ends start-up at once with one line that
names the flag at fault, instead of Sanic's traceback after seconds of start-up. It listens
only once Sanic serves (asyncio's server calls `listen` with `--listen-backlog`): a client that
connects while the model loads is refused, as before, not held in the kernel's queue.
"""

from __future__ import annotations

import errno
import ipaddress
import socket

# errno -> (the flag at fault, what to do); any other error names both flags.
_PORT_ERRORS = {
    errno.EADDRINUSE: "another process listens there; choose another --port or stop it",
    errno.EACCES: "ports below 1024 need privileges; choose a port of 1024 or more",
}
_HOST_ERRORS = {
    errno.EADDRNOTAVAIL: "not an address of this machine; use one of its addresses, 127.0.0.1 "
    "or 0.0.0.0",
    errno.EAFNOSUPPORT: "this machine does not support that address family",
}


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port, not yet listening, as Sanic's own `bind_socket` would
    make it (IPv6 for an IPv6 address, IPv4 for a name); ValueError names the flag at fault, the
    address and the OS's reason. (A port another socket listens on fails here: SO_REUSEADDR
    lets a bind share a port only with sockets that do not listen.)"""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:  # a host name, resolved by bind
        family = socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(bind_failure(host, port, exc)) from None
    sock.set_inheritable(True)
    return sock


def bind_failure(host: str, port: int, exc: OSError) -> str:
    """One line for an address that could not be bound: flag, address, OS reason, remedy."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    reason = exc.strerror or str(exc)
    if isinstance(exc, socket.gaierror):
        return (f"--host {host}: cannot listen on {address}: {reason} (not an IP address or a "
                "name this machine resolves)")
    if exc.errno in _PORT_ERRORS:
        return f"--port {port}: cannot listen on {address}: {reason} ({_PORT_ERRORS[exc.errno]})"
    if exc.errno in _HOST_ERRORS:
        return f"--host {host}: cannot listen on {address}: {reason} ({_HOST_ERRORS[exc.errno]})"
    return f"--host {host} --port {port}: cannot listen on {address}: {reason}"
