"""Sampled tokens, their log-probabilities and their most likely alternatives, over rows.

The log-probabilities are of the model's own distribution: the log-softmax of the raw logits,
before any sampling control (penalties, logit bias, temperature, top-p/k, min-p) changes them,
as vLLM reports by default. Computed on the device for every row at once; `to_host` reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

# Re-exported: the record is the engine's message (runtime/api.py, importable without MLX).
from runtime.api import TokenLogprob as TokenLogprob


@dataclass(frozen=True)
class LogprobArrays:
    """Lazy arrays for B rows: each chosen token's log-probability (B,) and the `num_top` most
    likely tokens of each row (B, num_top), most likely first."""

    chosen: mx.array
    top_ids: mx.array | None
    top_logprobs: mx.array | None

    def take(self, rows: mx.array) -> LogprobArrays:
        """The same arrays for the rows at `rows` only."""
        return LogprobArrays(self.chosen[rows],
                             None if self.top_ids is None else self.top_ids[rows],
                             None if self.top_logprobs is None else self.top_logprobs[rows])

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.chosen, self.top_ids, self.top_logprobs) if a is not None]

    def to_host(self, tokens: Sequence[int],
                num_top: Sequence[int | None]) -> list[TokenLogprob | None]:
        """Row i's record (token tokens[i]) with its first num_top[i] alternatives (None where
        num_top[i] is None)."""
        chosen: list[float] = self.chosen.tolist()  # type: ignore[assignment]
        ids: list[list[int]] = [] if self.top_ids is None else self.top_ids.tolist()  # type: ignore[assignment]
        lps: list[list[float]] = [] if self.top_logprobs is None \
            else self.top_logprobs.tolist()  # type: ignore[assignment]
        out: list[TokenLogprob | None] = []
        for i, (token, wanted) in enumerate(zip(tokens, num_top, strict=True)):
            top = tuple(zip(ids[i][:wanted], lps[i][:wanted], strict=True)) if wanted else ()
            out.append(None if wanted is None else TokenLogprob(token, chosen[i], top))
        return out


# A sampled token and its log-probabilities (None: not asked for).
Token = tuple[int, TokenLogprob | None]


@dataclass(frozen=True)
class Sampled:
    """Lazy results of one sampling step over B rows: the tokens (B,) and, when a row asked for
    them, the log-probabilities."""

    tokens: mx.array
    logprobs: LogprobArrays | None = None

    def take(self, rows: mx.array) -> Sampled:
        """The same results for the rows at `rows` only."""
        return Sampled(self.tokens[rows], None if self.logprobs is None
                       else self.logprobs.take(rows))

    def arrays(self) -> list[mx.array]:
        return [self.tokens, *(self.logprobs.arrays() if self.logprobs else ())]

    def to_host(self, num_top: Sequence[int | None]) -> list[Token]:
        """Row i's token, with its log-probabilities and num_top[i] alternatives when not None."""
        tokens: list[int] = self.tokens.tolist()  # type: ignore[assignment]
        if self.logprobs is None:
            return [(token, None) for token in tokens]
        return list(zip(tokens, self.logprobs.to_host(tokens, num_top), strict=True))


def logprob_arrays(logits: mx.array, tokens: mx.array, num_top: int) -> LogprobArrays:
    """The log-probabilities of `tokens` (B,) under `logits` (B, vocab), and the `num_top` most
    likely tokens of each row (none when 0)."""
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, tokens.astype(mx.int32)[:, None], axis=-1)[:, 0]
    if num_top == 0:
        return LogprobArrays(chosen, None, None)
    num_top = min(num_top, logprobs.shape[-1])
    ids = mx.argpartition(-logprobs, kth=num_top - 1, axis=-1)[:, :num_top]
    values = mx.take_along_axis(logprobs, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return LogprobArrays(chosen, mx.take_along_axis(ids, order, axis=-1),
                         mx.take_along_axis(values, order, axis=-1))


def prompt_logprob_arrays(logits: mx.array, prompt: Sequence[int], start: int, known: int,
                          num_top: int) -> LogprobArrays:
    """The log-probabilities of prompt tokens known + 1, ... from a slice's logits (one row per
    position from `start`: position p's row gives token p + 1), up to the prompt's last token."""
    stop = min(start + logits.shape[0], len(prompt) - 1)
    tokens = mx.array(prompt[known + 1: stop + 1])
    return logprob_arrays(logits[known - start: stop - start], tokens, num_top)
