"""Per-sequence token samplers over MLX; what they apply is runtime/sampling_params.py's
`SamplingParams` (re-exported here).

Each sequence owns its PRNG key (from its seed, or a random one), split once per sampled token,
so a seeded request draws the same tokens whichever batch it runs in.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p

# Re-exported: the engine's callers import it from here.
from runtime.sampling_params import SamplingParams as SamplingParams


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
