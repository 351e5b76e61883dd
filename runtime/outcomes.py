"""What became of each request the engine took: one log line and the outcome metrics.

The engine records an outcome once per request, where it lets the request go: finished (a stop
token or string, or max_tokens) or aborted (by cause). Requests refused before the engine took
them are counted by the server (server.app), by HTTP status and reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from runtime.api import AbortCause, FinishReason
from runtime.metrics import EngineMetrics

log = logging.getLogger("fairtick.requests")


@dataclass(frozen=True)
class RequestOutcome:
    """One request's end, with its token counts and clocks (seconds, from its submission)."""

    request_id: str
    finish_reason: FinishReason
    cause: AbortCause | None  # None: it finished (stop or length)
    num_prompt_tokens: int
    num_generated_tokens: int
    queue_s: float | None  # submission to first admission; None: never admitted
    ttft_s: float | None  # submission to first token; None: no token
    e2e_s: float  # submission to the end
    num_preemptions: int

    def describe(self) -> str:
        """The log line: `request ID finished: key=value ...` (or `aborted: cause=...`)."""
        head = "finished:" if self.cause is None else f"aborted: cause={self.cause}"
        fields = {"finish_reason": self.finish_reason,
                  "prompt_tokens": self.num_prompt_tokens,
                  "completion_tokens": self.num_generated_tokens,
                  "queue_s": _seconds(self.queue_s), "ttft_s": _seconds(self.ttft_s),
                  "e2e_s": _seconds(self.e2e_s), "preemptions": self.num_preemptions}
        return f"request {self.request_id} {head} " + " ".join(
            f"{key}={value}" for key, value in fields.items())


def record_outcome(outcome: RequestOutcome, metrics: EngineMetrics) -> None:
    """Count the outcome and log its line (INFO, logger `fairtick.requests`)."""
    if outcome.cause is None:
        metrics.requests_finished.labels(outcome.finish_reason).inc()
        metrics.e2e_latency.observe(outcome.e2e_s)
    else:
        metrics.requests_aborted.labels(outcome.cause).inc()
    log.info("%s", outcome.describe())


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
