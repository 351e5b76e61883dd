"""The batched sampling step: every row's controls applied at once, as per-row arrays.

A batch of logits (B, vocab) becomes B tokens in one pass of array operations, whatever mix of
controls the rows ask for; no Python loop runs over the rows' vocabularies. In order:

1. `logit_bias` (added), `repetition_penalty` (vLLM's: a seen token's logit divided by it when
   positive, multiplied when negative; seen = in the prompt or generated), `frequency_penalty`
   and `presence_penalty` (OpenAI's: minus count x frequency, minus presence if count > 0, over
   the tokens generated so far), EOS masked where `min_tokens`/`ignore_eos` ask;
   then a grammar's mask (`allowed`, structured output: runtime/grammar.py), last of the
   controls, so what follows chooses among the tokens the grammar allows (a truncation first
   could keep none of them);
2. greedy rows (temperature 0) take the argmax of these logits;
3. the others: `top_p` (mlx-lm's `apply_top_p`, given per-row values), `min_p`, `top_k`
   (mlx-lm's order: on the distribution before temperature; ties with the k-th token are
   kept), then the Gumbel argmax at the row's temperature with noise drawn from the row's own
   PRNG key (as `mx.random.categorical` draws).

A row's state (`RowState`: its PRNG key, its generated tokens' counts, its prompt's tokens) lives
with its batch row and moves with it (runtime/decode_batch.py), so a seeded row draws the same
tokens whichever batch it runs in: its noise depends on its key alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_top_p

from runtime.logprobs import Sampled, logprob_arrays
from runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class RowState:
    """What sampling carries from one token to the next, for B rows: PRNG keys (B, 2); counts of
    each generated token (B, vocab), kept when a row has penalties; the prompt's tokens as a mask
    (B, vocab), kept when a row has a repetition penalty. A None array is all zeros."""

    keys: mx.array
    counts: mx.array | None = None
    seen: mx.array | None = None

    @property
    def num_rows(self) -> int:
        return int(self.keys.shape[0])

    def take(self, rows: Sequence[int]) -> RowState:
        """The state of the rows at `rows`, in that order."""
        index = mx.array(rows)
        return RowState(self.keys[index], None if self.counts is None else self.counts[index],
                        None if self.seen is None else self.seen[index])

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.keys, self.counts, self.seen) if a is not None]


def concat_states(states: Sequence[RowState]) -> RowState:
    """One state of every row of `states`, in order; missing arrays become zeros."""
    keys = mx.concatenate([s.keys for s in states])
    return RowState(keys, _concat_or_zeros([s.counts for s in states], states, mx.int32),
                    _concat_or_zeros([s.seen for s in states], states, mx.bool_))


def _concat_or_zeros(parts: list[mx.array | None], states: Sequence[RowState],
                     dtype: mx.Dtype) -> mx.array | None:
    present = [p for p in parts if p is not None]
    if not present:
        return None
    vocab = present[0].shape[-1]
    filled = [p if p is not None else mx.zeros((s.num_rows, vocab), dtype=dtype)
              for p, s in zip(parts, states, strict=True)]
    return filled[0] if len(filled) == 1 else mx.concatenate(filled)


def prompt_state(key: mx.array, prompt: Sequence[int], params: SamplingParams,
                 vocab_size: int) -> RowState:
    """The state of a row about to sample its first token after `prompt`."""
    counts = seen = None
    if params.has_penalties:
        counts = mx.zeros((1, vocab_size), dtype=mx.int32)
    if params.repetition_penalty != 1.0:
        seen = mx.zeros((1, vocab_size), dtype=mx.int32)
        if len(prompt):
            seen = seen.at[0, mx.array(prompt, dtype=mx.int32)].add(1)
        seen = seen > 0
    return RowState(key[None], counts, seen)


def sample_rows(logits: mx.array, params: Sequence[SamplingParams], state: RowState,
                eos_row: mx.array | None, blocked: Sequence[bool],
                allowed: mx.array | None = None) -> tuple[Sampled, RowState]:
    """Row i's token under params[i] from logits (B, vocab) and its state; the state after it.
    `eos_row` (vocab,) holds -inf at the EOS ids; it is added to the rows where `blocked`.
    `allowed` (B, vocab), when given, is a grammar's mask: a False token cannot be drawn. The
    log-probabilities are the raw logits' (unmasked), as for every other control."""
    x = _processed(logits, params, state)
    if eos_row is not None and any(blocked):
        x = mx.where(mx.array(blocked)[:, None], x + eos_row, x)
    if allowed is not None:
        x = mx.where(allowed, x, -mx.inf)
    tokens = mx.argmax(x, axis=-1)
    keys = state.keys
    if not all(p.is_greedy for p in params):
        keys, drawn = _draw(x, params, state.keys)
        tokens = mx.where(mx.array([p.is_greedy for p in params]), tokens, drawn)
    counts = state.counts
    if counts is not None:
        counts = counts.at[mx.arange(len(params)), tokens].add(1)
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    logprobs = logprob_arrays(logits, tokens, max(wanted)) if wanted else None
    return Sampled(tokens, logprobs), replace(state, keys=keys, counts=counts)


_TINY = float(np.finfo(np.float32).tiny)


def _column(values: list[float], dtype: mx.Dtype = mx.float32) -> mx.array:
    return mx.array(values, dtype=dtype)[:, None]


def _processed(logits: mx.array, params: Sequence[SamplingParams], state: RowState) -> mx.array:
    # Logit bias, then the penalties (vLLM's order); rows without them are left exactly as
    # they were (x + 0, x * 1).
    x = logits
    biased = [(i, token, bias) for i, p in enumerate(params) for token, bias in p.logit_bias]
    if biased:
        rows, ids, values = zip(*biased, strict=True)
        x = x.at[mx.array(rows), mx.array(ids)].add(mx.array(values, dtype=x.dtype))
    if state.counts is None:
        return x
    counts = state.counts
    generated = counts > 0
    repetition = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in repetition):
        seen = generated if state.seen is None else generated | state.seen
        factor = _column(repetition)
        x = mx.where(seen, mx.where(x < 0, x * factor, x / factor), x)
    frequency = _column([p.frequency_penalty for p in params])
    presence = _column([p.presence_penalty for p in params])
    return x - frequency * counts - presence * generated


def _draw(x: mx.array, params: Sequence[SamplingParams],
          keys: mx.array) -> tuple[mx.array, mx.array]:
    # The new keys and each row's token drawn at its temperature (greedy rows: a placeholder).
    # The filters and the draw need the log-probabilities only up to a constant a row: the
    # logits less their maximum (no logsumexp; the top token stays at 0).
    x = x.astype(mx.float32)
    x = x - mx.max(x, axis=-1, keepdims=True)
    top_p = [p.top_p for p in params]
    if any(v < 1.0 for v in top_p):
        # At least float32's smallest normal number: a smaller top_p (still > 0, so valid)
        # would round to 0 in float32, keep no token and draw one of probability 0.
        column = _column([max(v, _TINY) for v in top_p])
        x = mx.where(column < 1.0, apply_top_p(x, column), x)
    min_p = [p.min_p for p in params]
    if any(v > 0.0 for v in min_p):
        x = mx.where(x < mx.log(_column(min_p)), -mx.inf, x)
    vocab = x.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        x = _keep_top_k(x, top_k)
    split = _split_keys(keys)
    noise = mx.vmap(lambda key: mx.random.gumbel(shape=(vocab,), key=key))(split[:, 1])
    inverse = _column([1.0 / p.temperature if p.temperature > 0 else 1.0 for p in params])
    return split[:, 0], mx.argmax(x * inverse + noise, axis=-1)


_split_keys = mx.vmap(mx.random.split)


def _keep_top_k(x: mx.array, top_k: list[int]) -> mx.array:
    # Row i keeps its top_k[i] largest (0: all), and any tied with the k-th; one partial sort of
    # the largest max(top_k) values, not a sort of the vocabulary.
    largest = max(top_k)
    values = mx.sort(mx.topk(x, largest, axis=-1), axis=-1)  # ascending: the k-th at -k
    index = mx.array([largest - k if k else 0 for k in top_k])[:, None]
    floor = mx.take_along_axis(values, index, axis=-1)
    floor = mx.where(mx.array([k > 0 for k in top_k])[:, None], floor, -mx.inf)
    return mx.where(x < floor, -mx.inf, x)
