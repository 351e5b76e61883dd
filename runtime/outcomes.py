"""What became of each response the engine took: one log line and the outcome metrics.

A response is every sequence of one client request: each choice (`n`) of each prompt (a
completions batch is one engine request per prompt, all under the id its client saw). The engine
adds each sequence's end to its response's tally and records the response once, when its last
sequence ends: finished (every sequence ended by a stop token or string, or max_tokens) or
aborted (by cause). Requests refused before the engine took them (all of a batch's prompts, when
one of them was refused) are counted by the server (server.app), by HTTP status and reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from runtime.api import AbortCause, FinishReason, GenerationRequest
from runtime.metrics import EngineMetrics

log = logging.getLogger("fairtick.requests")


@dataclass(frozen=True)
class RequestOutcome:
    """One response's end, with its token counts and clocks (seconds, from its submission)."""

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


@dataclass(frozen=True)
class SequenceEnd:
    """How one sequence (one choice of one prompt) ended; `end_s` on the monotonic clock."""

    finish_reason: FinishReason
    cause: AbortCause | None  # None: it finished (stop or length)
    num_generated_tokens: int
    end_s: float  # its last token (finished) or its abort
    num_preemptions: int


class ResponseTally:
    """One response's sequences until the last has ended. Its clocks (monotonic seconds) are the
    response's: the submission of its first prompt, its first admission, its first token."""

    def __init__(self, response_id: str, num_prompts: int, submitted_s: float) -> None:
        self.response_id = response_id
        self.submitted_s = submitted_s
        self.admitted_s: float | None = None
        self.first_token_s: float | None = None
        self.num_pending = num_prompts  # prompts the engine has not taken yet
        self.num_live = 0  # sequences taken that have not ended
        self.num_prompt_tokens = 0  # each prompt once, however many choices share it
        self.refused = False
        self._ends: list[SequenceEnd] = []  # in the order they ended

    @property
    def done(self) -> bool:
        return self.num_pending == 0 and self.num_live == 0

    def take(self, num_prompt_tokens: int) -> None:
        """One of its prompts was taken: its first choice is a live sequence."""
        self.num_pending -= 1
        self.num_live += 1
        self.num_prompt_tokens += num_prompt_tokens

    def fork(self) -> None:
        """A sibling choice of a prompt it holds became a live sequence."""
        self.num_live += 1

    def admit(self, now_s: float) -> bool:
        """A sequence was admitted; True if it is the response's first admission."""
        first = self.admitted_s is None
        if first:
            self.admitted_s = now_s
        return first

    def first_token(self, now_s: float) -> bool:
        """A sequence sampled its first token; True if it is the response's first token."""
        first = self.first_token_s is None
        if first:
            self.first_token_s = now_s
        return first

    def end(self, end: SequenceEnd) -> None:
        self.num_live -= 1
        self._ends.append(end)

    def outcome(self) -> RequestOutcome:
        """The response's one outcome (once done). Aborted, with the cause and finish_reason of
        its first sequence that ended unfinished, if any did; else finished, `length` if any
        choice ran out of max_tokens, else `stop`. Tokens generated and preemptions are summed
        over its sequences."""
        assert self.done and self._ends, "outcome of a response still running"
        aborted = next((e for e in self._ends if e.cause is not None), None)
        if aborted is not None:
            reason: FinishReason = aborted.finish_reason
        else:
            reason = "length" if any(e.finish_reason == "length" for e in self._ends) else "stop"
        since = self.submitted_s
        return RequestOutcome(
            self.response_id, reason, None if aborted is None else aborted.cause,
            self.num_prompt_tokens, sum(e.num_generated_tokens for e in self._ends),
            None if self.admitted_s is None else self.admitted_s - since,
            None if self.first_token_s is None else self.first_token_s - since,
            max(e.end_s for e in self._ends) - since, sum(e.num_preemptions for e in self._ends))


class Outcomes:
    """The engine's responses: each sequence's end goes to its response's tally, and a response
    is counted and logged once, when its last sequence has ended."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self.metrics = metrics
        self._batches: dict[str, ResponseTally] = {}  # batches with prompts still to come

    def take(self, request: GenerationRequest, submitted_s: float) -> ResponseTally:
        """The tally of the response `request` is a prompt of (a new one for its first prompt),
        with that prompt taken."""
        key = request.client_id
        tally = self._batches.pop(key, None) if request.num_prompts > 1 else None
        if tally is None:
            tally = ResponseTally(key, request.num_prompts, submitted_s)
        tally.take(len(request.prompt_tokens))
        if tally.num_pending:
            self._batches[key] = tally
        return tally

    def refuse(self, response_id: str) -> None:
        """A prompt of batch `response_id` was refused, and the prompts after it will not come:
        the response is a refusal, which the server counts, so it is not counted here."""
        tally = self._batches.pop(response_id, None)
        if tally is not None:
            tally.refused, tally.num_pending = True, 0

    def end(self, tally: ResponseTally, end: SequenceEnd) -> None:
        """A sequence of `tally`'s response ended; the response is recorded if it was the
        last."""
        tally.end(end)
        if tally.done and not tally.refused:
            record_outcome(tally.outcome(), self.metrics)


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
