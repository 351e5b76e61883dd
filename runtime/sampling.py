"""Per-sequence samplers over MLX; what they apply is runtime/sampling_params.py's
`SamplingParams` (re-exported here), and the batched step is runtime/row_sampling.py.

Each sequence owns its sampling state (PRNG key from its seed or a random one, split once per
sampled token; counts of its tokens when it has penalties). It lives here until the sequence
joins the decode batch, which then keeps it with the sequence's row, so a seeded request draws
the same tokens whichever batch it runs in.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection, Sequence

import mlx.core as mx

from runtime.logprobs import Sampled
from runtime.row_sampling import RowState, prompt_state, sample_rows

# Re-exported: the engine's callers import it from here.
from runtime.sampling_params import SamplingParams as SamplingParams


class SequenceSampler:
    """One sequence's sampling parameters, and its sampling state while it is not in the decode
    batch (the batch holds it meanwhile: runtime/decode_batch.py)."""

    def __init__(self, params: SamplingParams, eos_token_ids: Collection[int], vocab_size: int,
                 prompt: Sequence[int] = ()) -> None:
        self.params = params
        self._eos = mx.array(sorted(eos_token_ids), dtype=mx.int32) if eos_token_ids else None
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.state = prompt_state(mx.random.key(seed), prompt, params, vocab_size)

    def blocks_eos(self, step: int) -> bool:
        """Whether EOS is masked out for the token with index `step` (0 = first token)."""
        return self._eos is not None and (self.params.ignore_eos or step < self.params.min_tokens)

    def eos_row(self, vocab_size: int) -> mx.array | None:
        """A (vocab,) row of zeros with -inf at the EOS ids (None: the model has none)."""
        if self._eos is None:
            return None
        return mx.zeros((vocab_size,)).at[self._eos].add(-mx.inf)

    def sample(self, logits: mx.array, step: int, allowed: mx.array | None = None) -> Sampled:
        """The token (and log-probabilities, if asked) for `logits` of shape (1, vocab), among
        the `allowed` ones if a grammar's mask is given; the sampler's state moves on past it."""
        sampled, self.state = sample_batch(logits, [self], [step], self.state, allowed)
        return sampled


def sample_batch(logits: mx.array, samplers: Sequence[SequenceSampler], steps: Sequence[int],
                 state: RowState, allowed: mx.array | None = None) -> tuple[Sampled, RowState]:
    """Tokens (lazy) for a batch of logits (B, vocab), row i by samplers[i] at its token index
    steps[i], from the rows' sampling `state` (and among the tokens `allowed` (B, vocab) by the
    rows' grammars, when given); the state after them."""
    blocked = [s.blocks_eos(n) for s, n in zip(samplers, steps, strict=True)]
    eos_row = samplers[0].eos_row(logits.shape[-1]) if any(blocked) else None
    return sample_rows(logits, [s.params for s in samplers], state, eos_row, blocked, allowed)
