"""The server under test (Target) and what the phases ask of it besides completions: gauges,
what it still holds after a phase, health, its process's RSS; how a reply or a failure reads."""

from __future__ import annotations

import http.client
import socket
import time
from dataclasses import dataclass
from typing import Any

from benchlib.client import Reply, ServerError, exchange, get_json, get_metrics

GAUGES = ("fairtick_requests_running", "fairtick_requests_waiting", "fairtick_requests_parked")


@dataclass(frozen=True)
class Target:
    """The server under test, as discovered from /v1/models and /debug/state."""

    url: str
    model: str
    context_length: int
    max_running: int
    max_waiting: int
    chunk_size: int
    pid: int | None
    timeout_s: float

    def exchange(self, method: str, path: str, body: Any = None, **options: Any) -> Reply:
        """One request on a fresh connection (benchlib.client.exchange, this target's timeout)."""
        return exchange(self.url, method, path, body, timeout_s=self.timeout_s, **options)

    def get_json(self, path: str) -> Any:
        return get_json(self.url, path, self.timeout_s)


def failure_kind(exc: BaseException) -> str:
    """How a request failed below HTTP: a hang, a reset connection, a refusal."""
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return "hang"
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, (ConnectionError, http.client.HTTPException)):
        return "reset"
    return type(exc).__name__


def retry_after_s(reply_headers: dict[str, str]) -> float | None:
    try:
        value = float(reply_headers.get("retry-after", ""))
    except ValueError:
        return None
    return value if value >= 0 else None


def is_json_error(reply: Reply) -> bool:
    """Whether `reply` carries an OpenAI-style error object."""
    try:
        error = reply.json()["error"]
        return isinstance(error["message"], str) and set(error) >= {"type", "param", "code"}
    except (ValueError, KeyError, TypeError):
        return False


def leftovers(t: Target) -> dict[str, float]:
    """What the server still holds: gauges, live sequences, admission, cached sequences."""
    metrics = get_metrics(t.url)
    left = {name: metrics.get(name, 0.0) for name in GAUGES}
    state = t.get_json("/debug/state")
    left["live sequences"] = len(state.get("sequences", []))
    admission = state.get("admission", {})
    left["queued (admission)"] = admission.get("queued", 0)
    left["KV tokens cached"] = state.get("kv", {}).get("cached_tokens", 0)
    left["cached sequences"] = state.get("memory", {}).get("cached_sequences", 0)
    return left


def wait_drained(t: Target, timeout_s: float) -> dict[str, float]:
    """Poll until the server holds nothing (bounded); what it still held at the end."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = leftovers(t)
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def health_ok(t: Target) -> bool:
    try:
        return bool(t.get_json("/health").get("status") == "ok")
    except (OSError, http.client.HTTPException, ValueError, ServerError):
        return False


def rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def settled_rss(pid: int | None, start: int | None, limit_mib: float) -> int | None:
    """The lowest RSS over up to 5 s (allocators give memory back lazily), early once within
    a quarter of the limit of `start`."""
    lowest = rss_bytes(pid)
    for _ in range(10):
        if lowest is None or start is None or lowest - start <= limit_mib * 2**20 / 4:
            break
        time.sleep(0.5)
        lowest = min(lowest, rss_bytes(pid) or lowest)
    return lowest
