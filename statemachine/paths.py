"""The observed sequence's queue wait as a longest path, so the checker's keys need not hold it.

No transition reads how long a sequence has waited for KV room (admission is in arrival order,
preemption takes the youngest), so two worlds that differ only in that counter have the same
futures. The checker therefore explores worlds without it and records, along every edge that
keeps the same observed sequence, how the step function moved the counter: grew by `w`
(`adds`), or restarted at a value (`starts`, after a preemption). The largest value the
counter reaches is then the longest path through those edges: exact while it stays at or
under the claimed bound; past the bound (a cycle that grows it included) the checker explores
that chunk size again with the counter in its keys, for the counterexample.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

Node = TypeVar("Node", bound=Hashable)


def longest(adds: Mapping[Node, Sequence[tuple[Node, int]]], starts: Mapping[Node, int],
            cap: int) -> int:
    """The largest value any node reaches when every node starts at 0 (or at `starts`) and an
    edge (u -> v, w) gives v at least u's value + w; a value past `cap` is returned as soon as
    it appears (a growing cycle would never settle)."""
    value: dict[Node, int] = dict(starts)
    if any(v > cap for v in value.values()):
        return max(value.values())
    # Sources in discovery (breadth-first) order: most values settle on the first pass.
    work, queued = deque(adds), set(adds)
    while work:
        u = work.popleft()
        queued.discard(u)
        base = value.get(u, 0)
        for v, w in adds[u]:
            if base + w > value.get(v, 0):
                value[v] = base + w
                if base + w > cap:
                    return base + w
                if v in adds and v not in queued:
                    work.append(v)
                    queued.add(v)
    return max(value.values(), default=0)
