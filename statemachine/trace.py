"""The transition trace: one event per lifecycle change, kept in a bounded ring buffer.

The same JSON-lines format is written by the server's /debug/trace and by `fairtick check`
for a counterexample, so one reader (`format_table`) serves both.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TraceEvent:
    """`seq` went from `src` to `dst` by `trigger` in `tick`, which `rule` decided."""

    tick: int
    seq: int
    src: str
    dst: str
    trigger: str
    rule: str
    time: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"tick": self.tick, "time": self.time, "seq": self.seq, "from": self.src,
                "to": self.dst, "trigger": self.trigger, "rule": self.rule}


class TraceLog:
    """A thread-safe ring buffer of the last `capacity` events (the engine thread writes,
    the server reads)."""

    def __init__(self, capacity: int = 100_000) -> None:
        self._events: deque[TraceEvent] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def record(self, event: TraceEvent) -> None:
        with self._lock:
            self._events.append(event)

    def events(self, since_tick: int = 0, limit: int | None = None) -> list[dict[str, Any]]:
        """Events of tick >= `since_tick`, oldest first, at most `limit` of them."""
        with self._lock:
            picked = [e for e in self._events if e.tick >= since_tick]
        return [e.to_dict() for e in picked[:limit]]

    def __len__(self) -> int:
        return len(self._events)


def to_jsonl(events: Iterable[dict[str, Any]]) -> str:
    """One JSON object per line."""
    return "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events)


def format_table(events: Iterable[dict[str, Any]]) -> str:
    """A readable table of trace events."""
    header = ("tick", "seq", "from", "to", "trigger", "rule")
    rows = [tuple(str(e.get(k, "")) for k in header) for e in events]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in [header, *rows]]
    return "\n".join(lines)
