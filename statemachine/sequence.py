"""The sequence model: one request's lifecycle record inside the scheduler core."""

from __future__ import annotations

from typing import Any


class Sequence:
    """A `transitions` model. Its `state` (set by the shared Machine) is the only record of where
    the sequence is; the rest are plain counters, updated once per tick, never via triggers.

    A plain class on purpose: the Machine keys models by identity, and a dataclass with value
    equality would let two equal sequences be merged.
    """

    state: str
    trigger: Any  # bound by the Machine on add_model

    def __init__(self, seq_id: int, prompt_tokens: int, chunk_size: int) -> None:
        self.seq_id = seq_id
        self.prefill_left = prompt_tokens  # prompt tokens not yet prefilled
        self.chunk_size = chunk_size
        self.num_chunks = -(-prompt_tokens // chunk_size)
        self.wait_ticks = 0  # ticks parked since admission or the last grant
        self.age_ticks = 0  # ticks since admission
        self.overtaken = 0  # grants others received since this one's last grant
        self.num_grants = 0  # chunks (or slices) run so far

    def has_prefill_left(self) -> bool:
        """Guard: the prompt still has tokens to prefill."""
        return self.prefill_left > 0

    @property
    def chunks_left(self) -> int:
        return -(-self.prefill_left // self.chunk_size)

    @property
    def chunks_expected(self) -> int:
        """Grants so far plus whole chunks left: the prompt's chunk count when every grant runs
        a whole chunk; a lower bound when a policy runs smaller slices."""
        return self.num_grants + self.chunks_left

    def __repr__(self) -> str:
        return f"Sequence({self.seq_id}, {getattr(self, 'state', '?')})"
