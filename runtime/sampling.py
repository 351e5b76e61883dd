"""Sampling parameters and per-sequence token samplers.

Each sequence owns its PRNG key (from its seed, or a random one), split once per sampled token,
so a seeded request draws the same tokens whichever batch it runs in.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p

MAX_TEMPERATURE = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when its generation may stop."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> SamplingParams:
        """Raise ValueError naming the first bad field and its allowed range; return self."""
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be a number in [0, {MAX_TEMPERATURE:g}] (0 means greedy), "
                f"got {self.temperature!r}"
            )
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63) or None, got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class SequenceSampler:
    """Chooses one sequence's tokens from its logits; keeps its PRNG key between calls."""

    def __init__(self, params: SamplingParams, eos_token_ids: Collection[int]) -> None:
        self.params = params
        self._eos = mx.array(sorted(eos_token_ids), dtype=mx.int32) if eos_token_ids else None
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._key = mx.random.key(seed)
        self._prev_key = self._key  # the key before the latest split, for `rewind`

    def blocks_eos(self, step: int) -> bool:
        """Whether EOS is masked out for the token with index `step` (0 = first token)."""
        return self._eos is not None and (self.params.ignore_eos or step < self.params.min_tokens)

    def mask_eos(self, logits: mx.array) -> mx.array:
        assert self._eos is not None
        return logits.at[..., self._eos].add(-mx.inf)

    def rewind(self) -> None:
        """Undo the latest `sample`'s use of the key (its token was thrown away)."""
        self._key = self._prev_key

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        """The PRNG keys (current, before the latest split); set it to go back to them."""
        return self._key, self._prev_key

    @state.setter
    def state(self, keys: tuple[mx.array, mx.array]) -> None:
        self._key, self._prev_key = keys

    def sample(self, logits: mx.array, step: int) -> mx.array:
        """One token id (shape (1,)) from `logits` of shape (1, vocab)."""
        if self.blocks_eos(step):
            logits = self.mask_eos(logits)
        if self.params.is_greedy:
            return mx.argmax(logits, axis=-1)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self.params.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.params.top_p)
        if 0 < self.params.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, self.params.top_k)
        self._prev_key = self._key
        self._key, sub = mx.random.split(self._key)
        return mx.random.categorical(logprobs * (1.0 / self.params.temperature), key=sub)


def sample_batch(
    logits: mx.array, samplers: Sequence[SequenceSampler], steps: Sequence[int]
) -> mx.array:
    """Token ids (shape (B,), lazy) for a batch of logits (B, vocab), row i by samplers[i]."""
    if all(s.params.is_greedy for s in samplers):
        # The common case: one argmax over the batch, EOS masked per row where needed.
        rows = [i for i, (s, n) in enumerate(zip(samplers, steps, strict=True)) if s.blocks_eos(n)]
        if rows:
            blocked = mx.zeros((logits.shape[0], 1), dtype=mx.bool_)
            blocked[mx.array(rows)] = True
            eos = samplers[rows[0]].mask_eos(mx.zeros((1, logits.shape[-1])))
            logits = mx.where(blocked, logits + eos, logits)
        return mx.argmax(logits, axis=-1)
    tokens = [
        s.sample(logits[i : i + 1], n) for i, (s, n) in enumerate(zip(samplers, steps, strict=True))
    ]
    return mx.concatenate(tokens)
