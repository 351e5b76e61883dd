"""The decode batch: every decoding sequence's rows in one mlx-lm `BatchKVCache` per layer.

Sequences merge in when they first decode (left padded, with a mask, as mlx-lm's
`BatchGenerator` does) and are filtered out when released or evicted; a sequence alive but not
stepped (paused) is extracted back into its own `KVCache`. Each row's sampling state (PRNG key,
token counts: runtime/row_sampling.py) moves with its cache row. Joining and leaving cost one
copy of the batch cache; a step with an unchanged batch costs none. That copy is the other
streams' gap: in-process on the built-in model, 4 streams finishing at 800, 1,400, 2,000 and
2,600 tokens, the tick after each of the first two left took 12.8-17.4 ms against a step of
1.5-2 ms (a copy kept out of the tick, a left row held until a newcomer takes its place, is
not built). The batch may hold one step queued ahead of what was returned (`ahead`), which
`rewind` undoes.

A full cache grows by copying everything it holds into a larger buffer, in every layer, inside
the step that needs the room (mlx-lm's `update_and_fetch`). mlx-lm grows by 256 positions, so
every 256 tokens every stream froze for that copy: measured on the built-in model, 14 ms at 4
rows of 2,304 keys and 57-132 ms at 16 rows of 2,304-6,144 (a tick's target there is ~20-60 ms).
`reserve` makes each growth half the capacity held (at least 256 positions, at most
`MAX_GROWTH`, never past what the longest row can still add), so the copies come ever rarer,
for at most half the capacity (or MAX_GROWTH positions a row) held unused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from runtime.logprobs import Sampled
from runtime.row_sampling import RowState, concat_states
from runtime.sampling import SequenceSampler


class Member(Protocol):
    """What the batch needs of a sequence: its own cache (None while in the batch), its
    sampler (whose state is stale while in the batch)."""

    cache: list[Any] | None
    sampler: SequenceSampler


@dataclass(frozen=True)
class Queued:
    """A step queued on every row (caches advanced) that no tick has returned yet: what it
    sampled, and the rows' sampling state before it."""

    sampled: Sampled
    before: RowState

    def take(self, rows: list[int]) -> Queued:
        return Queued(self.sampled.take(mx.array(rows)), self.before.take(rows))


MIN_GROWTH = 256  # mlx-lm's own step
MAX_GROWTH = 2048  # positions a row; bounds the memory held ahead of use


def growth(capacity: int, most_left: int) -> int:
    """Positions a full batch cache of `capacity` grows by, its rows able to add at most
    `most_left` more tokens: half the capacity, within [MIN_GROWTH, MAX_GROWTH], no more than
    `most_left` (but MIN_GROWTH at least, mlx-lm's own)."""
    return max(MIN_GROWTH, min(capacity // 2, MAX_GROWTH, most_left))


class DecodeBatch:
    """Rows of the decoding sequences in `cache` and their sampling `state`; row i belongs to
    `ids[i]` (None: released or evicted, dropped at the next `regroup`)."""

    def __init__(self, members: Mapping[int, Member]) -> None:
        self._members = members
        self.ids: list[int | None] = []
        self.cache: list[BatchKVCache] | None = None
        self.state: RowState | None = None
        self.ahead: Queued | None = None

    @property
    def live_ids(self) -> list[int]:
        return [i for i in self.ids if i is not None]

    def drop(self, seq_id: int) -> None:
        """Forget the sequence's row; a sequence still alive (evicted) takes its sampling state
        back (its cache is not wanted back)."""
        if seq_id in self.ids:
            row = self.ids.index(seq_id)
            member = self._members.get(seq_id)
            if member is not None and self.state is not None:
                member.sampler.state = self.state.take([row])
            self.ids[row] = None
            if all(i is None for i in self.ids):
                self.ids, self.cache, self.state, self.ahead = [], None, None, None

    def reserve(self, most_left: Callable[[], int]) -> None:
        """Before a step: if it fills the caches, have them grow by `growth` (the rows can add
        at most `most_left()` more tokens, asked only then)."""
        assert self.cache is not None
        first = self.cache[0]
        keys, used = getattr(first, "keys", None), getattr(first, "_idx", None)
        if keys is None or used is None or used + 1 < keys.shape[2]:
            return
        step = growth(keys.shape[2], most_left())
        for c in self.cache:
            c.step = step

    def rewind(self) -> None:
        """Undo the queued step: its token leaves every row's cache, the rows' sampling state
        goes back to before it."""
        assert self.cache is not None and self.ahead is not None
        for c in self.cache:
            c.trim(1)
        self.state = self.ahead.before
        self.ahead = None

    def regroup(self, ids: list[int]) -> None:
        """Make the batch hold exactly `ids`: drop released rows, park the others in their own
        caches, merge newcomers at the end."""
        wanted = set(ids)
        keep = [i for i, seq_id in enumerate(self.ids) if seq_id in wanted]
        if len(keep) < len(self.ids):
            assert self.cache is not None and self.state is not None
            for i, seq_id in enumerate(self.ids):
                if seq_id is not None and seq_id not in wanted:
                    member = self._members[seq_id]
                    member.cache = [c.extract(i) for c in self.cache]
                    member.sampler.state = self.state.take([i])
            if keep:
                for c in self.cache:
                    c.filter(keep)
                self.state = self.state.take(keep)
                if self.ahead is not None:
                    self.ahead = self.ahead.take(keep)
            else:
                self.cache, self.state = None, None
            self.ids = [self.ids[i] for i in keep]
        present = set(self.ids)
        joining = [seq_id for seq_id in ids if seq_id not in present]
        if joining:
            self._merge(joining)

    def _merge(self, joining: list[int]) -> None:
        caches, states = [], []
        for seq_id in joining:
            member = self._members[seq_id]
            assert member.cache is not None
            caches.append(member.cache)
            states.append(member.sampler.state)
            member.cache = None
        merged = [BatchKVCache.merge(list(layer)) for layer in zip(*caches, strict=True)]
        if self.cache is None:
            self.cache = merged
        else:
            for batch, new in zip(self.cache, merged, strict=True):
                batch.extend(new)
        self.state = concat_states(states if self.state is None else [self.state, *states])
        self.ids.extend(joining)
