"""The decode batch: every decoding sequence's rows, in groups, each group's rows in one mlx-lm
`BatchKVCache` per layer.

Sequences join when they first decode (left padded, with a mask, as mlx-lm's `BatchGenerator`
does) and are filtered out when released or evicted; a sequence alive but not stepped (paused)
is extracted back into its own `KVCache`. Each row's sampling state (PRNG key, token counts:
runtime/row_sampling.py) moves with its cache row; the rows' order is the groups' rows in turn,
and each group is one segment of the step's forward (runtime/fused.py), attended apart. A step
with an unchanged batch copies nothing, but a row joining or leaving a group copies the whole
group: `extend` pads every row to the longest and concatenates, `filter` gathers the rest. In
one group, a 10,000-token prompt joining 4 streams at ~1,500 tokens padded them all to its
length: the streams' next token came 209 ms late (in-process, built-in model; 105 ms for a
4,000-token prompt), and its leaving 72 ms. So a newcomer joins the group it copies least only
while that copy is small (`JOIN_COPY_BYTES`), else its own cache becomes a group of its own,
copied not at all (`place`, up to `MAX_GROUPS`; a group whose rows all leave is dropped, no
copy either): that prompt's join took 15-19 ms, its leaving 10 ms (its KV, alone in its
group, handed to the prefix cache uncopied: runtime/executor.py `kv_of`). A group costs its
step's forward a few ops a layer: 4 rows of 300 tokens beside one of 4,000, 3.4-3.5 ms a step
in two groups against 3.1-3.2 ms padded in one. A row leaving a group of several still
copies it (4 streams finishing at 800, 1,400, 2,000 and 2,600 tokens: the tick after each of
the first two took 12.8-17.4 ms against a 1.5-2 ms step; a left row held as a hole until a
newcomer takes its place is not built). The batch may hold one step queued ahead of what was
returned (`ahead`), which `rewind` undoes.

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
from itertools import accumulate
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from runtime.fused import Segment
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


# Joining a group of rows copies all of them (mlx-lm's `extend`: every row padded to the
# longest, then concatenated), and so does a row leaving it (`filter`). A newcomer joins the group
# it copies least, when that copy is at most JOIN_COPY_BYTES of KV; else it starts a group of its
# own (no copy: its cache becomes the group's), up to MAX_GROUPS. Each group is one segment of
# the decode step's forward, attended apart: a few more small ops a layer for each.
JOIN_COPY_BYTES = 8 << 20
MAX_GROUPS = 4


@dataclass
class Group:
    """Rows that share one mlx-lm `BatchKVCache` per layer; row i belongs to `ids[i]` (None:
    released or evicted, dropped at the next `regroup`)."""

    ids: list[int | None]
    cache: list[BatchKVCache]

    @property
    def length(self) -> int:
        """Positions each row spans (the longest row's keys, the rest left padded)."""
        return int(self.cache[0]._idx)


def place(groups: list[tuple[int, int]], length: int, bytes_per_position: int) -> int | None:
    """Which of `groups` ((rows, length) each) a newcomer of `length` positions joins: the one
    whose join copies least, if that copy is at most JOIN_COPY_BYTES or MAX_GROUPS are there
    already; None: a group of its own."""
    if not groups:
        return None
    copies = [(rows + 1) * max(held, length) * bytes_per_position for rows, held in groups]
    best = min(range(len(groups)), key=copies.__getitem__)
    return best if copies[best] <= JOIN_COPY_BYTES or len(groups) >= MAX_GROUPS else None


def _single(cache: Any) -> BatchKVCache:
    # A sequence's own KVCache as a one-row batch cache over the same buffers: no copy.
    batch = BatchKVCache([0])
    n = int(cache.offset)
    batch.keys, batch.values = cache.keys, cache.values
    batch.offset, batch._idx = mx.array([n]), n
    return batch


class DecodeBatch:
    """Rows of the decoding sequences in `groups` and their sampling `state`; the rows' order
    (`ids`) is the groups' rows in turn."""

    def __init__(self, members: Mapping[int, Member]) -> None:
        self._members = members
        self.groups: list[Group] = []
        self.state: RowState | None = None
        self.ahead: Queued | None = None

    @property
    def ids(self) -> list[int | None]:
        return [i for g in self.groups for i in g.ids]

    @property
    def live_ids(self) -> list[int]:
        return [i for i in self.ids if i is not None]

    @property
    def caches(self) -> list[list[BatchKVCache]]:
        """Each group's caches, in row order."""
        return [g.cache for g in self.groups]

    def segments(self, inputs: mx.array) -> list[Segment]:
        """A decode step's segments of the forward: one a group, each with its rows' `inputs`
        (one token a row, in the rows' order)."""
        if len(self.groups) == 1:
            return [Segment(inputs[:, None], self.groups[0].cache, logits=True)]
        cuts = list(accumulate(len(g.ids) for g in self.groups))[:-1]
        return [Segment(part, g.cache, logits=True)
                for part, g in zip(mx.split(inputs[:, None], cuts), self.groups, strict=True)]

    def locate(self, seq_id: int) -> tuple[Group, int]:
        """The sequence's group and its row there; ValueError if it has none."""
        for g in self.groups:
            if seq_id in g.ids:
                return g, g.ids.index(seq_id)
        raise ValueError(f"sequence {seq_id} is not in the decode batch")

    def drop(self, seq_id: int) -> None:
        """Forget the sequence's row; a sequence still alive (evicted) takes its sampling state
        back (its cache is not wanted back)."""
        if seq_id in self.ids:
            row = self.ids.index(seq_id)
            member = self._members.get(seq_id)
            if member is not None and self.state is not None:
                member.sampler.state = self.state.take([row])
            group, at = self.locate(seq_id)
            group.ids[at] = None
            if all(i is None for i in self.ids):
                self.groups, self.state, self.ahead = [], None, None

    def reserve(self, most_left: Callable[[], int]) -> None:
        """Before a step: the groups it fills grow by `growth` (the rows can add at most
        `most_left()` more tokens, asked only then)."""
        for group in self.groups:
            first = group.cache[0]
            keys, used = getattr(first, "keys", None), getattr(first, "_idx", None)
            if keys is None or used is None or used + 1 < keys.shape[2]:
                continue
            step = growth(keys.shape[2], most_left())
            for c in group.cache:
                c.step = step

    def rewind(self) -> None:
        """Undo the queued step: its token leaves every row's cache, the rows' sampling state
        goes back to before it."""
        assert self.groups and self.ahead is not None
        for group in self.groups:
            for c in group.cache:
                c.trim(1)
        self.state = self.ahead.before
        self.ahead = None

    def regroup(self, ids: list[int]) -> None:
        """Make the batch hold exactly `ids`: drop released rows, park the others in their own
        caches, place newcomers (`place`)."""
        wanted = set(ids)
        flat = self.ids
        keep = [r for r, seq_id in enumerate(flat) if seq_id in wanted]
        if len(keep) < len(flat):
            self._leave(wanted, keep)
        present = set(self.ids)
        joining = [seq_id for seq_id in ids if seq_id not in present]
        if joining:
            self._join(joining)

    def _leave(self, wanted: set[int], keep: list[int]) -> None:
        assert self.state is not None
        groups, start = [], 0
        for group in self.groups:
            rows = [r for r, seq_id in enumerate(group.ids) if seq_id in wanted]
            for r, seq_id in enumerate(group.ids):
                if seq_id is not None and seq_id not in wanted:
                    member = self._members[seq_id]
                    member.cache = [c.extract(r) for c in group.cache]
                    member.sampler.state = self.state.take([start + r])
            start += len(group.ids)
            if not rows:
                continue  # the whole group leaves: nothing to copy
            if len(rows) < len(group.ids):
                for c in group.cache:
                    c.filter(rows)
            groups.append(Group([group.ids[r] for r in rows], group.cache))
        self.groups = groups
        if keep:
            self.state = self.state.take(keep)
            if self.ahead is not None:
                self.ahead = self.ahead.take(keep)
        else:
            self.state, self.ahead = None, None

    def _join(self, joining: list[int]) -> None:
        members = [self._members[seq_id] for seq_id in joining]
        caches = []
        for member in members:
            assert member.cache is not None
            caches.append(member.cache)
            member.cache = None
        per_position = sum(int(c.keys.nbytes + c.values.nbytes) // max(1, c.keys.shape[2])
                           for c in caches[0])
        shapes = [(len(g.ids), g.length) for g in self.groups]
        targets: dict[int, list[int]] = {}  # group index (new ones past the old) -> joiners
        for k, cache in enumerate(caches):
            at = place(shapes, int(cache[0].offset), per_position)
            if at is None:
                at = len(shapes)
                shapes.append((0, 0))
            rows, held = shapes[at]
            shapes[at] = (rows + 1, max(held, int(cache[0].offset)))
            targets.setdefault(at, []).append(k)
        # The rows' new order: each group's rows, then those joining it.
        old, order, start = len(self.ids), [], 0
        for at in range(len(shapes)):
            if at < len(self.groups):
                order += range(start, start + len(self.groups[at].ids))
                start += len(self.groups[at].ids)
            order += [old + k for k in targets.get(at, [])]
        for at, ks in sorted(targets.items()):
            layers = list(zip(*(caches[k] for k in ks), strict=True))
            if at < len(self.groups):
                for batch, layer in zip(self.groups[at].cache, layers, strict=True):
                    batch.extend(BatchKVCache.merge(list(layer)))
                self.groups[at].ids.extend(joining[k] for k in ks)
            else:
                merged = [_single(layer[0]) if len(ks) == 1 else BatchKVCache.merge(list(layer))
                          for layer in layers]
                self.groups.append(Group([joining[k] for k in ks], merged))
        states = [m.sampler.state for m in members]
        state = concat_states(states if self.state is None else [self.state, *states])
        self.state = state if order == list(range(len(order))) else state.take(order)
