"""The trace in the Trace Event Format (JSON): opens in ui.perfetto.dev and chrome://tracing.

Process 1, "requests": one track (thread) per sequence, named by its request id, with a
complete slice ("X") per lifecycle state it was in, a nested slice per wait run (the rule that
kept it waiting), and an instant ("i") where it ended; refusals are instants on track 0.
Process 2, "engine": one track with a slice per tick (its action; rule, decode rows and prefill
tokens as arguments) and counters ("C") for the batch and the KV tokens in use. Timestamps and
durations are microseconds since the server started (or since the first event of a file).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from statemachine.trace import TickRecord

REQUESTS_PID, ENGINE_PID, ENGINE_TID = 1, 2, 1


def to_perfetto(events: Sequence[dict[str, Any]], ticks: Iterable[TickRecord] = (),
                started: float | None = None) -> dict[str, Any]:
    """The Trace Event Format object for trace events (dicts of /debug/trace) and ticks."""
    ticks = list(ticks)
    times = [e["time"] for e in events if e.get("time") is not None] + [t.time for t in ticks]
    origin = started if started is not None else min(times, default=0.0)
    end = max([t.time + t.seconds for t in ticks] + times, default=origin)

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    out: list[dict[str, Any]] = [
        _meta("process_name", REQUESTS_PID, 0, "requests"),
        _meta("process_name", ENGINE_PID, ENGINE_TID, "engine"),
        _meta("thread_name", ENGINE_PID, ENGINE_TID, "ticks"),
        _meta("thread_name", REQUESTS_PID, 0, "refusals"),
    ]
    out += _sequence_tracks(events, us, end)
    for t in ticks:
        args = {"tick": t.tick, "rule": t.rule, "decode_rows": t.decode_rows,
                "prefill_tokens": t.prefill_tokens}
        out.append({"ph": "X", "name": t.action, "cat": "tick", "pid": ENGINE_PID,
                    "tid": ENGINE_TID, "ts": us(t.time), "dur": round(t.seconds * 1e6, 3),
                    "args": args})
        out.append({"ph": "C", "name": "batch", "pid": ENGINE_PID, "ts": us(t.time),
                    "args": {"decode_rows": t.decode_rows, "prefill_tokens": t.prefill_tokens}})
        out.append({"ph": "C", "name": "kv_tokens", "pid": ENGINE_PID, "ts": us(t.time),
                    "args": {"kv_tokens": t.kv_tokens}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def _sequence_tracks(events: Sequence[dict[str, Any]], us: Any, end: float) -> list[dict]:
    out: list[dict[str, Any]] = []
    by_seq: dict[int, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("time") is None:
            continue
        if e.get("seq") is None:  # a refusal: the request never became a sequence
            out.append({"ph": "i", "s": "t", "name": f"refused: {e.get('rule')}",
                        "cat": "refusal", "pid": REQUESTS_PID, "tid": 0, "ts": us(e["time"]),
                        "args": {"request_id": e.get("request_id")}})
            continue
        by_seq.setdefault(int(e["seq"]), []).append(e)
    for seq, evs in sorted(by_seq.items()):
        tid = seq + 1  # 0 is the refusals' track
        name = next((e["request_id"] for e in evs if e.get("request_id")), None)
        out.append(_meta("thread_name", REQUESTS_PID, tid,
                         f"seq {seq}" + (f" {name}" if name else "")))
        moves = [e for e in evs if e.get("kind", "transition") != "wait"]
        for i, e in enumerate(moves):
            stop = moves[i + 1]["time"] if i + 1 < len(moves) else None
            if stop is None and e.get("trigger") in ("finish", "abort"):
                out.append({"ph": "i", "s": "t", "name": e["to"], "cat": "end",
                            "pid": REQUESTS_PID, "tid": tid, "ts": us(e["time"]),
                            "args": {"rule": e.get("rule")}})
                continue
            stop = end if stop is None else stop
            out.append({"ph": "X", "name": e["to"], "cat": "state", "pid": REQUESTS_PID,
                        "tid": tid, "ts": us(e["time"]),
                        "dur": round(max(0.0, stop - e["time"]) * 1e6, 3),
                        "args": {"trigger": e.get("trigger"), "rule": e.get("rule"),
                                 "tick": e.get("tick")}})
        for e in evs:
            if e.get("kind") == "wait":
                out.append({"ph": "X", "name": f"waits: {e['rule']}", "cat": "wait",
                            "pid": REQUESTS_PID, "tid": tid, "ts": us(e["time"]),
                            "dur": round((e.get("seconds") or 0.0) * 1e6, 3),
                            "args": {"ticks": e.get("ticks"), "rule": e["rule"],
                                     "ongoing": e.get("ongoing", False)}})
    return out


def _meta(name: str, pid: int, tid: int, value: str) -> dict[str, Any]:
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "args": {"name": value}}
