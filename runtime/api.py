"""Messages between the engine thread and its callers (the server, tests, benchmarks).

The engine owns MLX on one thread. Callers hand it a `GenerationRequest` and a sink; the engine
calls the sink from its own thread with one `TokenEvent` per generated token and a last event
that carries the finish reason. A sink must be cheap and thread-safe (the server's sink does
`loop.call_soon_threadsafe(queue.put_nowait, event)`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from runtime.sampling_params import SamplingParams

FinishReason = Literal["stop", "length", "abort", "error"]
# Why a request ended before it finished: its client went away (or the caller gave up), the
# server shut down, or its generation (or the engine) failed.
AbortCause = Literal["client_disconnect", "server_shutdown", "error"]


@dataclass(frozen=True)
class GenerationRequest:
    """One request as the engine sees it: already tokenized and validated."""

    request_id: str
    prompt_tokens: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_prompt: bool = True  # False: neither reuse a cached prefix nor leave one behind


@dataclass(frozen=True)
class TokenEvent:
    """A generated token (text may be empty while a multi-byte character is incomplete), or the
    end of the request when `finish_reason` is set; `error` says why when it is "error"."""

    request_id: str
    token_id: int | None
    text: str
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


Sink = Callable[[TokenEvent], None]


class EngineFull(Exception):
    """The waiting queue or the KV token budget is full; retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineDead(Exception):
    """The engine thread has stopped; no request can be served."""
