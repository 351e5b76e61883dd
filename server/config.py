"""Server configuration: one frozen dataclass, validated when built."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from server.logs import check_log_level
from server.validation import DEFAULT_CHAT_MAX_TOKENS, DEFAULT_MAX_BODY_BYTES

if TYPE_CHECKING:
    from runtime.engine import EngineConfig


@dataclass(frozen=True)
class ServerConfig:
    """How to serve. `engine=None` means the engine's defaults (used when none is injected)."""

    engine: EngineConfig | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # A whole (non-streamed) generation may legitimately wait a long time in the queue.
    response_timeout_s: float = 3600.0
    # A request's headers and body must arrive within this (Sanic's request timeout covered the
    # headers only: a body that stalled held its connection for the response timeout).
    request_timeout_s: float = 60.0
    # On shutdown, how long requests in flight may still run before they are aborted (503).
    stop_grace_s: float = 5.0
    # Connections the kernel queues before the server accepts them. Sanic's default of 100 lets
    # a burst of clients overflow it: their connections stall for a SYN retry or are reset
    # instead of getting their 429. The kernel caps it at net.core.somaxconn.
    listen_backlog: int = 1024
    # The ids requests may name; the first is the one reported. Empty: the model directory's name.
    served_model_names: tuple[str, ...] = ()
    # max_tokens of a chat request that sends none (cut to the room its prompt leaves).
    default_chat_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS
    # Requests must carry `Authorization: Bearer <api_key>`; None serves without a key.
    api_key: str | None = field(default=None, repr=False)
    # With api_key: also ask it of the operator routes (/health, /metrics, /version, /debug/*).
    api_key_protect_ops: bool = False
    # Origins whose browsers may call the API (CORS); "*" for any; empty: no CORS headers at all.
    allowed_origins: tuple[str, ...] = ()
    # The level of every logger (server.logs), applied by `fairtick serve` at start-up.
    log_level: str = "info"
    # One line per response (Sanic's access log, at INFO); off by default.
    access_log: bool = False
    # The model cards' `created` (Unix seconds); None: when the app is made. A cluster gives its
    # replicas one value, so /v1/models answers the same whichever replica serves it.
    created: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if not self.response_timeout_s > 0:
            raise ValueError(f"response_timeout_s must be > 0, got {self.response_timeout_s}")
        if self.listen_backlog < 1:
            raise ValueError(f"listen_backlog must be at least 1, got {self.listen_backlog}")
        if not (self.stop_grace_s >= 0 and math.isfinite(self.stop_grace_s)):
            raise ValueError(f"stop_grace_s must be a finite number of seconds >= 0, got "
                             f"{self.stop_grace_s}")
        if not 1 <= self.default_chat_max_tokens <= MAX_DEFAULT_MAX_TOKENS:
            raise ValueError(f"default_chat_max_tokens must be in 1..{MAX_DEFAULT_MAX_TOKENS}, "
                             f"got {self.default_chat_max_tokens}")
        _check_names(self.served_model_names)
        check_log_level(self.log_level)
        if self.api_key is not None and not _API_KEY.fullmatch(self.api_key):
            raise ValueError("api_key must be 1 or more printable ASCII characters without "
                             "spaces (it travels in an HTTP header)")
        if self.api_key_protect_ops and self.api_key is None:
            raise ValueError("api_key_protect_ops needs an api_key")
        for origin in self.allowed_origins:
            if origin != "*" and not _ORIGIN.fullmatch(origin):
                raise ValueError(f"allowed_origins: {origin!r} is not '*' or an origin such as "
                                 "'https://app.example.com' or 'http://localhost:3000' (scheme "
                                 "and host, no path)")


MAX_DEFAULT_MAX_TOKENS = 2**31 - 1
_API_KEY = re.compile(r"[\x21-\x7e]+")
_ORIGIN = re.compile(r"https?://[^/\s,]+")


def _check_names(names: tuple[str, ...]) -> None:
    for name in names:
        if not name or name != name.strip():
            raise ValueError(f"served_model_names: {name!r} must be a non-empty name without "
                             "surrounding spaces")
    if len(set(names)) != len(names):
        raise ValueError(f"served_model_names: a name is given twice in {list(names)}")
