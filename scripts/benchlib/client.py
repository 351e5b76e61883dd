"""A stdlib HTTP client for a running `fairtick serve`: raw exchanges, JSON routes, /metrics,
and streamed completions whose token arrival times are recorded on the monotonic clock."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


class ServerError(RuntimeError):
    """The server could not be reached or answered with an error."""


@dataclass
class Reply:
    """A whole HTTP answer; header names lower-cased."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def connect(url: str, timeout_s: float) -> http.client.HTTPConnection:
    """A (not yet opened) connection to the server at `url`, e.g. http://127.0.0.1:8000."""
    parts = urllib.parse.urlparse(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"--url must look like http://127.0.0.1:PORT, got {url!r}")
    return http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)


def exchange(url: str, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
             content_type: str | None = "application/json", chunked: bool = False,
             timeout_s: float = 30.0) -> Reply:
    """One request on a fresh connection, whatever its status: `body` as JSON, or `raw` bytes as
    they are (in two chunks when `chunked`). Raises OSError/HTTPException below HTTP."""
    conn = connect(url, timeout_s)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    headers = {"Content-Type": content_type} if content_type is not None and data else {}
    if chunked and data:
        headers["Transfer-Encoding"] = "chunked"
    try:
        try:
            conn.request(method, path, body=iter([data[:7], data[7:]]) if chunked and data
                         else data, headers=headers, encode_chunked=chunked)
        except (BrokenPipeError, ConnectionResetError):
            pass  # a server may answer (413) and close before a large body is sent: read it
        response = conn.getresponse()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()},
                     response.read())
    finally:
        conn.close()


def get_text(url: str, path: str, timeout_s: float = 30.0) -> str:
    """The body of GET `path`; ServerError unless it is 200."""
    try:
        reply = exchange(url, "GET", path, timeout_s=timeout_s)
    except OSError as exc:
        raise ServerError(f"cannot reach {url}{path}: {exc}") from exc
    body = reply.body.decode("utf-8", errors="replace")
    if reply.status != 200:
        raise ServerError(f"GET {path}: HTTP {reply.status}: {body[:300]}")
    return body


def get_json(url: str, path: str, timeout_s: float = 30.0) -> Any:
    return json.loads(get_text(url, path, timeout_s))


def get_trace(url: str, since_tick: int = 0) -> list[dict[str, Any]]:
    """/debug/trace events of tick >= since_tick."""
    text = get_text(url, f"/debug/trace?since={since_tick}")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def get_metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics, keyed `name` or `name{label="value",...}`."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(get_text(url, "/metrics")):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


def wait_until(check: Any, timeout_s: float, what: str, poll_s: float = 0.1) -> Any:
    """Poll `check()` until it returns a truthy value; TimeoutError names `what`."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except (ServerError, OSError, ValueError) as exc:
            last_error = exc
        time.sleep(poll_s)
    raise TimeoutError(f"{what} not reached within {timeout_s:.0f} s"
                       + (f" (last error: {last_error})" if last_error else ""))


def wait_idle(url: str, timeout_s: float = 60.0) -> None:
    """Until the server holds no live sequence."""
    wait_until(lambda: not get_json(url, "/debug/state")["sequences"], timeout_s,
               "an idle server")


class TimedStream:
    """One streamed /v1/completions request on its own thread, recording when each token
    arrives. `stop_after(t, n)` closes it (the server aborts it) once it has n tokens after t."""

    def __init__(self, url: str, prompt: str, max_tokens: int, timeout_s: float,
                 cache_prompt: bool = False) -> None:
        self.url, self.timeout_s = url, timeout_s
        # cache_prompt false unless asked: a prompt sent alone and then again in the scenario
        # is prefilled both times (fairtick's prefix cache would serve the second from the
        # first; other servers ignore the field).
        self.body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True,
                                "temperature": 0, "cache_prompt": cache_prompt})
        self.max_tokens = max_tokens
        self.sent_s: float | None = None
        self.times_s: list[float] = []
        self.error: str | None = None
        self.done = False  # ended with [DONE]
        self.cancelled = False  # closed by stop_after
        self.first_token = threading.Event()
        self._stop: tuple[float, int] | None = None
        self._conn: http.client.HTTPConnection | None = None
        # The connection forgets its socket once an HTTP/1.0 response (mlx_lm.server) begins.
        self._sock: socket.socket | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> TimedStream:
        self._thread.start()
        return self

    def stop_after(self, t_s: float, tail_tokens: int) -> None:
        self._stop = (t_s, tail_tokens)

    def close(self) -> None:
        """Drop the connection now (the server aborts the request), even while it waits."""
        self.cancelled = True
        conn = self._conn
        sock = self._sock or (conn.sock if conn is not None else None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def join(self, timeout_s: float) -> bool:
        """True once the thread has ended."""
        self._thread.join(max(0.0, timeout_s))
        return not self._thread.is_alive()

    @property
    def ended(self) -> bool:
        return not self._thread.is_alive()

    @property
    def ttft_s(self) -> float | None:
        if self.sent_s is None or not self.times_s:
            return None
        return self.times_s[0] - self.sent_s

    def _run(self) -> None:
        conn = self._conn = connect(self.url, self.timeout_s)
        try:
            self.sent_s = time.monotonic()
            conn.request("POST", "/v1/completions", body=self.body.encode(),
                         headers={"Content-Type": "application/json"})
            self._sock = conn.sock
            if self.cancelled:  # closed while connecting
                return
            self._read(conn.getresponse())
        except (OSError, ValueError, http.client.HTTPException) as exc:
            if not self.cancelled:
                self.error = f"{type(exc).__name__}: {exc}"
        finally:
            conn.close()
            self.first_token.set()  # wake a waiter even on failure

    def _read(self, response: http.client.HTTPResponse) -> None:
        if response.status != 200:
            body = response.read().decode(errors="replace")[:300]
            self.error = f"HTTP {response.status}: {body}"
            return
        while True:
            line = response.readline()
            now_s = time.monotonic()
            if not line:
                if self.cancelled:
                    return
                self.error = f"stream ended without [DONE] after {len(self.times_s)} tokens"
                return
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self.done = True
                return
            event = json.loads(data)
            if "error" in event:
                self.error = f"error event: {event['error']}"
                return
            if event["choices"][0].get("text"):
                self.times_s.append(now_s)
                self.first_token.set()
                if self._should_stop():
                    self.cancelled = True
                    return

    def _should_stop(self) -> bool:
        if self._stop is None:
            return False
        t_s, tail = self._stop
        return sum(1 for t in self.times_s[-tail:] if t > t_s) >= tail
