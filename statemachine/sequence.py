"""The sequence model: one request inside the scheduler core, a model of the shared Machine."""

from __future__ import annotations

from typing import Any

from statemachine.world import Seq


class SeqModel:
    """A `transitions` model. Its `state` (set by the shared Machine) is the record of where the
    sequence is; `rec` is the step function's record its guards read, set before each trigger
    (the scheduler keeps the current records, and checks they agree with the states).

    A plain class on purpose: the Machine keys models by identity, and a dataclass with value
    equality would let two equal sequences be merged.
    """

    state: str
    trigger: Any  # bound by the Machine on add_model

    def __init__(self, rec: Seq) -> None:
        self.rec = rec

    @property
    def seq_id(self) -> int:
        return self.rec.seq_id

    def has_prefill_left(self) -> bool:
        """Guard (the lifecycle's `has_prefill_left`): read from the record."""
        return self.rec.has_prefill_left()

    def __repr__(self) -> str:
        return f"SeqModel({self.rec.seq_id}, {getattr(self, 'state', '?')})"
