"""The scheduler's trace: what happened to each request, and why it waited, in a ring buffer.

Events (one JSON object each, in the order they began; docs/trace-event.schema.json):

- `transition`: a lifecycle change (`from` -> `to` by `trigger`, decided by `rule`);
- `arrival`: a request entered the scheduler (`to` is the initial state; `cached_tokens`: how
  many of its prompt tokens came from the prefix cache);
- `wait`: a run of ticks a sequence stayed parked or queued, under one `rule` (parked: the
  policy's rule that decided those ticks; queued: `running_limit` or `kv_budget`), compressed
  to one event with its first `tick`, `ticks` and `seconds` (grown in place while it lasts:
  `ongoing: true`);
- `refusal`: a request the engine refused at submission (`rule` says why).

Every event has the request id (when the engine knows it), `time` (wall clock, Unix seconds)
and `t_s` (seconds since the server started). The server's /debug/trace and `fairtick check`'s
counterexamples write the same JSON lines, so one reader (`format_table`) serves both. Tick
records (one per tick: action, rule, duration, batch, KV) are kept beside them for the
Perfetto export (server/trace_perfetto.py).

The buffer keeps events (but wait runs, which grow in place) and tick records as plain tuples
of numbers and strings, which Python's collector stops tracking. Kept as objects, every full
collection walked them with all threads stopped (every stream's gap): 56-65 ms for a full
buffer (100,000 of each, the default) on an idle machine; in an engine with 4 streams decoding,
one full collection in 240 s, 33.5 ms with the buffer half full, 9.7 ms with the records as
tuples.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Iterable
from itertools import islice
from typing import Any, NamedTuple

KINDS = ("transition", "arrival", "wait", "refusal")


class TraceEvent(NamedTuple):
    """`seq` went from `src` to `dst` by `trigger` in `tick`, which `rule` decided (for a
    `wait`: stayed in `src` for `ticks` ticks and `seconds` from `tick` on)."""

    tick: int
    seq: int | None
    src: str | None
    dst: str | None
    trigger: str
    rule: str
    time: float | None = None
    request_id: str | None = None
    kind: str = "transition"
    role: str | None = None  # the role of `dst` (statemachine.lifecycle.Role), for readers
    ticks: int | None = None
    seconds: float | None = None
    cached_tokens: int | None = None  # arrival only: prompt tokens found in the prefix cache

    def to_dict(self, started: float | None = None, ongoing: bool = False) -> dict[str, Any]:
        since = None if self.time is None or started is None else round(self.time - started, 6)
        out = {"tick": self.tick, "time": self.time, "t_s": since, "request_id": self.request_id,
               "seq": self.seq, "kind": self.kind, "from": self.src, "to": self.dst,
               "role": self.role, "trigger": self.trigger, "rule": self.rule}
        if self.kind == "wait":
            out |= {"ticks": self.ticks, "seconds": self.seconds, "ongoing": ongoing}
        elif self.kind == "arrival":
            out["cached_tokens"] = self.cached_tokens or 0
        return out


class TickRecord(NamedTuple):
    """One tick as the engine ran it: when it started (wall clock, Unix seconds), how long it
    took, what the policy decided, and how much it ran."""

    tick: int
    time: float
    seconds: float
    action: str
    rule: str
    decode_rows: int
    prefill_tokens: int
    kv_tokens: int


class _Run:
    """A wait run: appended when it opens (so the buffer stays in order of starts) and grown in
    place while the sequence keeps waiting under the same rule."""

    __slots__ = ("event", "ticks", "end", "open")

    def __init__(self, event: TraceEvent, now: float | None) -> None:
        self.event, self.ticks, self.end, self.open = event, 1, now, True

    def to_dict(self, started: float | None) -> dict[str, Any]:
        e = self.event
        grown = e._replace(ticks=self.ticks, seconds=_elapsed(e.time, self.end))
        return grown.to_dict(started, ongoing=self.open)


class TraceLog:
    """A thread-safe ring buffer of the last `capacity` events and tick records (the engine
    thread writes, the server reads). `started`: the server's start (wall clock), for `t_s`."""

    def __init__(self, capacity: int = 100_000, started: float | None = None) -> None:
        self.started = started
        # Events as plain tuples (wait runs, grown in place, as _Run), tick records too.
        self._events: deque[tuple[Any, ...] | _Run] = deque(maxlen=capacity)
        self._ticks: deque[tuple[Any, ...]] = deque(maxlen=capacity)
        self._open: dict[int, _Run] = {}  # seq -> its wait run still going on
        self._last: dict[int, float] = {}  # seq -> time of its latest event (a run's start)
        self._appended = 0  # events ever appended (the ring buffer drops the oldest)
        self._lock = threading.Lock()

    def record(self, event: TraceEvent) -> None:
        """Append an event (closing the sequence's open wait run)."""
        with self._lock:
            if event.seq is not None:
                self._close(event.seq)
                if event.time is not None:
                    self._last[event.seq] = event.time
            self._append(tuple(event))

    def waited(self, seq: int, request_id: str | None, state: str, role: str, rule: str,
               tick: int, now: float | None) -> None:
        """`seq` spent `tick` in `state` without moving, under `rule`: grow its wait run, or
        close it and open another when the rule changed."""
        with self._lock:
            run = self._open.get(seq)
            if run is not None and run.event.rule == rule and run.event.src == state:
                run.ticks, run.end = run.ticks + 1, now
                return
            self._close(seq)
            start = self._last.get(seq, now)
            run = _Run(TraceEvent(tick, seq, state, state, "wait", rule, start, request_id,
                                  "wait", role), now)
            self._open[seq] = run
            self._append(run)

    def _append(self, item: tuple[Any, ...] | _Run) -> None:
        self._events.append(item)
        self._appended += 1

    def left(self, seq: int) -> None:
        """`seq` ended: nothing more will come of it."""
        with self._lock:
            self._close(seq)
            self._last.pop(seq, None)

    def tick(self, record: TickRecord) -> None:
        with self._lock:
            self._ticks.append(tuple(record))

    def events(self, since_tick: int = 0, limit: int | None = None,
               request_id: str | None = None, since_s: float | None = None,
               state: str | None = None) -> list[dict[str, Any]]:
        """Events in the order they began, filtered: tick >= `since_tick`, of one request, at
        or after `since_s` seconds since the start, from or to `state`; the latest `limit`."""
        with self._lock:
            every = [e.to_dict(self.started) if isinstance(e, _Run)
                     else TraceEvent._make(e).to_dict(self.started) for e in self._events]
        picked = [e for e in every if e["tick"] >= since_tick
                  and (request_id is None or e["request_id"] == request_id)
                  and (state is None or state in (e["from"], e["to"]))
                  and (since_s is None or (e["t_s"] is not None and e["t_s"] >= since_s))]
        return picked[-limit:] if limit is not None else picked

    def transitions(self, start: int = 0) -> tuple[list[TraceEvent], int]:
        """The transitions among the events appended since the `start`-th ever (those the
        buffer still holds), and the count to pass as `start` next time: for a checker that
        reads every transition once without rendering the whole log each time."""
        with self._lock:
            skip = max(0, start - (self._appended - len(self._events)))
            fresh = list(islice(self._events, skip, None))
            count = self._appended
        events = [TraceEvent._make(e) for e in fresh if not isinstance(e, _Run)]
        return [e for e in events if e.kind == "transition"], count

    def ticks(self, since_tick: int = 0) -> list[TickRecord]:
        """Tick records of tick >= `since_tick`, oldest first."""
        with self._lock:
            records = list(self._ticks)
        return [r for r in map(TickRecord._make, records) if r.tick >= since_tick]

    def __len__(self) -> int:
        return len(self._events)

    def _close(self, seq: int) -> None:
        run = self._open.pop(seq, None)
        if run is not None:
            run.open = False
            if run.end is not None:
                self._last[seq] = run.end


def _elapsed(start: float | None, now: float | None) -> float | None:
    return None if start is None or now is None else round(max(0.0, now - start), 6)


def to_jsonl(events: Iterable[dict[str, Any]]) -> str:
    """One JSON object per line."""
    return "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events)


def format_table(events: Iterable[dict[str, Any]]) -> str:
    """A readable table of trace events (a wait run shows its ticks and seconds)."""
    header = ("tick", "t_s", "request", "seq", "from", "to", "trigger", "rule")
    rows = []
    for e in events:
        trigger = e.get("trigger", "")
        if e.get("kind") == "wait":
            trigger = f"wait x{e.get('ticks')} ({_seconds(e.get('seconds'))})" + \
                (" ongoing" if e.get("ongoing") else "")
        t_s = e.get("t_s")
        rows.append((str(e.get("tick", "")), "" if t_s is None else f"{t_s:.3f}",
                     str(e.get("request_id") or ""), str(e.get("seq", "")),
                     str(e.get("from") or ""), str(e.get("to") or ""), str(trigger),
                     str(e.get("rule", ""))))
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in [header, *rows]]
    return "\n".join(lines)


def _seconds(value: Any) -> str:
    return "?" if value is None else f"{value:.3f} s"
