"""Small stdlib HTTP helpers shared by the server and end-to-end tests."""

from __future__ import annotations

import http.client
import json
import urllib.parse
from typing import Any

from benchlib import client
from benchlib.serve import free_port as free_port  # re-exported for the tests


class Reply(client.Reply):
    """benchlib's reply, plus the checks tests make of error and SSE bodies."""

    def error(self) -> dict[str, Any]:
        """The OpenAI-style error object; fails the test if the body is not one."""
        body = self.json()
        assert set(body) == {"error"}, body
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        return dict(body["error"])

    def sse_data(self) -> list[str]:
        """The `data:` payloads of a server-sent-event body, in order."""
        text = self.body.decode()
        assert text.endswith("\n\n"), text[-200:]
        return [block[len("data: "):] for block in text.split("\n\n") if block]


def request(base_url: str, method: str, path: str, body: Any = None, *,
            raw: bytes | None = None, content_type: str | None = "application/json",
            headers: dict[str, str] | None = None, timeout_s: float = 30.0) -> Reply:
    """One request on a fresh connection; `raw` sends bytes as they are; `headers` are added."""
    url = urllib.parse.urlparse(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout_s)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    sent = {"Content-Type": content_type} if content_type and data is not None else {}
    try:
        conn.request(method, path, body=data, headers={**sent, **(headers or {})})
        response = conn.getresponse()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()},
                     response.read())
    finally:
        conn.close()


def post(base_url: str, path: str, body: Any = None, **kwargs: Any) -> Reply:
    return request(base_url, "POST", path, body, **kwargs)


def get(base_url: str, path: str, **kwargs: Any) -> Reply:
    return request(base_url, "GET", path, **kwargs)


class OpenStream:
    """A streaming POST whose connection the test can drop at any moment."""

    def __init__(self, base_url: str, path: str, body: dict[str, Any],
                 headers: dict[str, str] | None = None) -> None:
        url = urllib.parse.urlparse(base_url)
        self.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
        self.conn.request("POST", path, body=json.dumps(body).encode(),
                          headers={"Content-Type": "application/json", **(headers or {})})
        self.response = self.conn.getresponse()

    @property
    def request_id(self) -> str:
        return str(self.response.getheader("X-Request-Id"))

    def read_event(self) -> str:
        """The next `data:` payload."""
        line = b""
        while not line.startswith(b"data: "):
            line = self.response.readline()
            if not line:
                raise EOFError("stream ended")
        return line[len(b"data: "):].decode().rstrip("\n")

    def drop(self) -> None:
        """Close the socket without reading the rest, as a client that goes away does."""
        self.response.close()
        self.conn.close()


class SentRequest:
    """A POST sent on its own connection whose answer is never read: `drop()` closes the
    connection, as a client that gives up waiting for a whole body does."""

    def __init__(self, base_url: str, path: str, body: dict[str, Any]) -> None:
        url = urllib.parse.urlparse(base_url)
        self.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
        self.conn.request("POST", path, body=json.dumps(body).encode(),
                          headers={"Content-Type": "application/json"})

    def drop(self) -> None:
        self.conn.close()
