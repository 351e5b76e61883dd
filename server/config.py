"""Server configuration: one frozen dataclass, validated when built."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from server.validation import DEFAULT_MAX_BODY_BYTES

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
    # On shutdown, how long requests in flight may still run before they are aborted (503).
    stop_grace_s: float = 5.0
    # Connections the kernel queues before the server accepts them. Sanic's default of 100 lets
    # a burst of clients overflow it: their connections stall for a SYN retry or are reset
    # instead of getting their 429. The kernel caps it at net.core.somaxconn.
    listen_backlog: int = 1024

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if not self.response_timeout_s > 0:
            raise ValueError(f"response_timeout_s must be > 0, got {self.response_timeout_s}")
        if self.listen_backlog < 1:
            raise ValueError(f"listen_backlog must be at least 1, got {self.listen_backlog}")
        if not (self.stop_grace_s >= 0 and math.isfinite(self.stop_grace_s)):
            raise ValueError(f"stop_grace_s must be a finite number of seconds >= 0, got "
                             f"{self.stop_grace_s}")
