"""One choice of a request on the engine side (one sequence): its sink, its text stream, its
clocks, and the response it belongs to (runtime/outcomes.py)."""

from __future__ import annotations

from runtime.api import AbortCause, FinishReason, GenerationRequest, Sink, TokenEvent
from runtime.detok import TextStream
from runtime.logprobs import TokenLogprob
from runtime.metrics import EngineMetrics
from runtime.outcomes import ResponseTally, SequenceEnd


def kv_tokens(request: GenerationRequest) -> int:
    """KV cache tokens a request may hold: its prompt and every token it may generate."""
    return len(request.prompt_tokens) + request.sampling.max_tokens


class LiveRequest:
    """A choice of a request the engine holds: turns its sampled tokens into events and decides
    when it ends."""

    def __init__(self, seq_id: int, request: GenerationRequest, sink: Sink, tokenizer: object,
                 eos_token_ids: frozenset[int], response: ResponseTally, index: int = 0) -> None:
        self.seq_id, self.request, self.sink = seq_id, request, sink
        self.response = response  # every sequence of its client's request shares it
        self.index = index  # the choice this sequence generates (0 to n - 1)
        self.forked = False  # choice 0 only: its siblings were made at its first token
        self.stream = TextStream(tokenizer, request.sampling.stop)
        self.eos_token_ids = eos_token_ids
        self.admitted_s: float | None = None
        self.last_token_s: float | None = None
        self.num_generated = 0
        self.num_preemptions = 0  # the scheduler's count, copied from its preemption events
        self.num_cached = 0  # prompt tokens found in the prefix cache (set at arrival)
        self.finish_reason: FinishReason | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def kv_tokens(self) -> int:
        return kv_tokens(self.request)

    def accept(self, token: int, now_s: float, metrics: EngineMetrics,
               logprob: TokenLogprob | None = None,
               prompt_logprobs: tuple[TokenLogprob, ...] | None = None) -> bool:
        """Publish one sampled token (with its log-probabilities, and the prompt's, when they
        were asked for); True when the request is finished by it."""
        sampling = self.request.sampling
        if self.last_token_s is None:
            if self.response.first_token(now_s):  # observed once per response
                metrics.ttft.observe(now_s - self.response.submitted_s)
        else:
            metrics.itl.observe(now_s - self.last_token_s)
        self.last_token_s = now_s
        self.num_generated += 1
        metrics.generation_tokens.inc()
        if token in self.eos_token_ids and not sampling.ignore_eos:
            # EOS is not part of the text, so not of its log-probabilities either.
            self._end(self._event(token, self.stream.finish(), "stop", None, prompt_logprobs))
            return True
        text = self.stream.add(token)
        if self.stream.stopped:
            self._end(self._event(token, text, "stop", logprob, prompt_logprobs))
        elif self.num_generated >= sampling.max_tokens:
            self._end(self._event(token, text + self.stream.finish(), "length", logprob,
                                  prompt_logprobs))
        else:
            self._send(self._event(token, text, None, logprob, prompt_logprobs))
        return self.finish_reason is not None

    def end(self, reason: FinishReason, token: int | None = None, text: str = "",
            error: str | None = None) -> None:
        """Send the last event (once)."""
        self._end(self._event(token, text, reason, error=error))

    def _end(self, event: TokenEvent) -> None:
        if self.finish_reason is None:
            self.finish_reason = event.finish_reason
            self._send(event)

    def ended(self, now_s: float, cause: AbortCause | None) -> SequenceEnd:
        """How it ended (after `end`): `cause` None if it finished."""
        assert self.finish_reason is not None, "outcome of a request that has not ended"
        # A finished sequence ended with its last token; an aborted one ends now.
        end_s = self.last_token_s if cause is None and self.last_token_s is not None else now_s
        return SequenceEnd(self.finish_reason, cause, self.num_generated, end_s,
                           self.num_preemptions)

    def _event(self, token: int | None, text: str, reason: FinishReason | None,
               logprob: TokenLogprob | None = None,
               prompt_logprobs: tuple[TokenLogprob, ...] | None = None,
               error: str | None = None) -> TokenEvent:
        # One event built whole: this runs for every token of every stream, on the engine thread.
        return TokenEvent(self.request_id, token, text, reason, error,
                          num_prompt_tokens=len(self.request.prompt_tokens),
                          num_generated_tokens=self.num_generated,
                          num_cached_tokens=self.num_cached, index=self.index, logprob=logprob,
                          prompt_logprobs=prompt_logprobs)

    def _send(self, event: TokenEvent) -> None:
        try:
            self.sink(event)
        except Exception:  # noqa: BLE001 - a broken sink must not stop the engine
            pass
