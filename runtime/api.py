"""Messages between the engine thread and its callers (the server, tests, benchmarks).

The engine owns MLX on one thread. Callers hand it a `GenerationRequest` and a sink; the engine
calls the sink from its own thread with one `TokenEvent` per generated token and a last event
that carries the finish reason, for each of the request's `n` choices (events carry `index`).
A sink must be cheap and thread-safe (the server's sink does
`loop.call_soon_threadsafe(queue.put_nowait, event)`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from runtime.sampling_params import SamplingParams

if TYPE_CHECKING:  # runtime/grammar.py imports MLX; this module must not
    from runtime.grammar import Grammar

FinishReason = Literal["stop", "length", "abort", "error"]
# Why a request ended before it finished: its client went away (or the caller gave up), the
# server shut down, or its generation (or the engine) failed.
AbortCause = Literal["client_disconnect", "server_shutdown", "error"]


@dataclass(frozen=True)
class GenerationRequest:
    """One request as the engine sees it: already tokenized and validated. `n` choices share
    its prompt, prefilled once (choice j samples with `choice_sampling(sampling, j)`). With a
    `grammar` (a compiled response format or forced tool call), every token each choice samples
    is masked by it, each choice with a matcher of its own. A completions batch is one request
    per prompt (ids `ID-0`, `ID-1`, ...), each naming the response they make up, `response_id`
    (the id the client saw), and `num_prompts`: the engine counts, logs and traces that response
    once (runtime/outcomes.py)."""

    request_id: str
    prompt_tokens: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_prompt: bool = True  # False: neither reuse a cached prefix nor leave one behind
    n: int = 1
    grammar: Grammar | None = None
    response_id: str | None = None  # None: the response is this request alone
    num_prompts: int = 1  # the engine requests sharing `response_id`, submitted in order

    @property
    def client_id(self) -> str:
        """The id its client saw: its response's."""
        return self.response_id or self.request_id


# An odd constant near 2**64 / golden ratio (splitmix64's increment): seeds j apart stay apart.
_SEED_STEP = 0x9E3779B97F4A7C15


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed choice `index` of a request with `seed` samples with: the seed itself for choice
    0 (so n=1 is unchanged), `(seed + index * 0x9E3779B97F4A7C15) mod 2**63` for the others, so
    seeded siblings draw different tokens and each is reproduced by an n=1 request with its
    seed. None (unseeded) stays None: each choice draws a random key."""
    if seed is None or index == 0:
        return seed
    return (seed + index * _SEED_STEP) % 2**63


def choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """The sampling parameters of choice `index`: the request's, with `choice_seed`."""
    return replace(sampling, seed=choice_seed(sampling.seed, index))


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability and the `top` most likely tokens at its position, most likely
    first, as (token id, log-probability) pairs: the model's own distribution
    (runtime/logprobs.py)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """A generated token (text may be empty while a multi-byte character is incomplete), or the
    end of the request when `finish_reason` is set; `error` says why when it is "error".
    `logprob`: the token's log-probabilities when `sampling.logprobs` asked for them;
    `prompt_logprobs`: with the first token, prompt tokens 1, 2, ...'s when
    `sampling.prompt_logprobs` asked for them."""

    request_id: str
    token_id: int | None
    text: str
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0  # by this choice
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    index: int = 0  # the choice (0 to n - 1)
    logprob: TokenLogprob | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


Sink = Callable[[TokenEvent], None]


class EngineFull(Exception):
    """The waiting queue or the KV token budget is full; retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineDead(Exception):
    """The engine thread has stopped; no request can be served."""
