"""Methods of the real server's routes: every GET route answers HEAD with the GET's status and
headers and no body (RFC 9110 9.3.2); a POST route answers GET and HEAD with 405 `Allow: POST`.
The routes come from the app itself, so a route added later is covered too."""

from __future__ import annotations

import re
import socket
import urllib.parse

import pytest

from server.app import create_app
from server.config import ServerConfig

# Bodies that change from one request to the next (counters, memory, the trace's growth).
LIVE_PATHS = ("/metrics", "/debug/state", "/debug/trace")


def route_paths(method: str) -> list[str]:
    """The paths of the app's routes that take `method`, each parameter filled as `{name}`."""
    app = create_app(ServerConfig())
    return sorted(re.sub(r"<(\w+)(:\w+)?>", r"{\1}", f"/{route.path}")
                  for route in app.router.routes if method in route.methods)


def exchange(url: str, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and every byte after them, read on a raw socket to the connection's
    end: what http.client would hide of a HEAD response."""
    address = urllib.parse.urlparse(url)
    request = f"{method} {path} HTTP/1.1\r\nHost: {address.netloc}\r\nConnection: close\r\n\r\n"
    data = b""
    with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
        sock.sendall(request.encode())
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = {name.lower(): value.strip()
               for name, value in (line.split(":", 1) for line in lines)}
    return int(status_line.split()[1]), headers, body


def test_the_app_has_read_routes_and_post_routes():
    assert {"/v1/models", "/health", "/version", "/metrics", "/debug/trace",
            "/debug/state"} <= set(route_paths("GET"))
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize"} <= set(route_paths("POST"))


@pytest.mark.parametrize("path", [*route_paths("GET"), "/v1/models/no-such-model"])
def test_head_answers_as_get_without_a_body(server, model_name, path):
    path = path.format(model_id=urllib.parse.quote(model_name, safe=""))
    got_status, got_headers, got_body = exchange(server.url, "GET", path)
    status, headers, body = exchange(server.url, "HEAD", path)
    assert body == b"", body[:200]
    assert status == got_status and status in (200, 404), (status, got_status)
    assert headers["content-type"] == got_headers["content-type"]
    if path in LIVE_PATHS:
        assert int(headers["content-length"]) >= 0
    else:
        assert headers == got_headers and int(headers["content-length"]) == len(got_body)


@pytest.mark.parametrize("path", route_paths("POST"))
@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_a_post_route_refuses_get_and_head_naming_post(server, method, path):
    status, headers, body = exchange(server.url, method, path)
    assert (status, headers["allow"]) == (405, "POST"), (status, headers)
    assert (body == b"") == (method == "HEAD"), body[:200]


@pytest.mark.parametrize("path", ["/v1/models", "/health"])
def test_a_read_route_refuses_post_naming_get_and_head(server, path):
    status, headers, _ = exchange(server.url, "POST", path)
    assert status == 405 and set(headers["allow"].split(", ")) == {"GET", "HEAD"}, headers


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/models"), ("GET", "/health"),
                                              ("POST", "/v1/models")])
def test_no_header_is_sent_empty(server, method, path):
    # Sanic wrote `alt-svc:` with no value (not valid Alt-Svc, RFC 7838) on every response
    # unless its TouchUp ran; `fairtick serve` runs it.
    _, headers, _ = exchange(server.url, method, path)
    assert "alt-svc" not in headers and all(headers.values()), headers
