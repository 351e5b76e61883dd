"""One request's trace told in a few lines: each stretch it spent queued, prefilling or
decoding, in seconds from its arrival, with the rules that kept it waiting (`fairtick trace
--request ID`). Reads the event dicts of statemachine.trace, by role, so it holds for any
lifecycle's state names."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from statemachine.lifecycle import Role

# The stretch each role (an event's `role`: Role.word) belongs to.
PHASES = {Role.QUEUED.word: "queued", Role.PREEMPTED.word: "queued (preempted)",
          Role.PAUSED.word: "paused", Role.PARKED.word: "prefill",
          Role.PREFILLING.word: "prefill", Role.DECODING.word: "decode"}
ENDS = (Role.FINISHED.word, Role.ABORTED.word)


@dataclass
class _Stretch:
    phase: str
    start: float
    end: float
    grants: int = 0
    waits: dict[str, list[float]] = field(default_factory=dict)  # rule -> [ticks, seconds]

    def line(self, origin: float) -> str:
        text = f"{self.start - origin:9.3f} -{self.end - origin:9.3f} s  {self.phase}"
        details = []
        if self.grants:
            details.append(f"{self.grants} slice{'s' if self.grants > 1 else ''}")
        for rule, (ticks, seconds) in sorted(self.waits.items(), key=lambda kv: -kv[1][1]):
            details.append(f"waited {ticks:g} tick{'s' if ticks != 1 else ''} "
                           f"({seconds:.3f} s) under {rule}")
        return text + (": " + "; ".join(details) if details else "")


def format_request(events: Iterable[dict[str, Any]], request_id: str) -> str:
    """The story of `request_id` from its trace events (all kinds), one block per sequence."""
    mine = [e for e in events if e.get("request_id") == request_id and e.get("time") is not None]
    if not mine:
        return f"request {request_id}: no events in the trace (unknown, or older than the " \
            "trace's buffer)"
    blocks = [f"request {request_id}: refused ({e['rule']}) at t={e.get('t_s')} s"
              for e in mine if e.get("kind") == "refusal"]
    for seq in sorted({e["seq"] for e in mine if e.get("seq") is not None}):
        blocks.append(_sequence_story(request_id, seq, [e for e in mine if e.get("seq") == seq]))
    return "\n".join(blocks)


def _sequence_story(request_id: str, seq: int, events: list[dict[str, Any]]) -> str:
    origin = events[0]["time"]
    stretches: list[_Stretch] = []
    first_token, preemptions, outcome = None, 0, "still live"
    for e in events:
        role, now = e.get("role"), e["time"]
        if e.get("kind") == "wait":
            if stretches:
                ticks, seconds = stretches[-1].waits.setdefault(e["rule"], [0, 0.0])
                stretches[-1].waits[e["rule"]] = [ticks + (e.get("ticks") or 0),
                                                  seconds + (e.get("seconds") or 0.0)]
                stretches[-1].end = max(stretches[-1].end, now + (e.get("seconds") or 0.0))
            continue
        if stretches:
            stretches[-1].end = max(stretches[-1].end, now)
        if e.get("trigger") == "grant" and stretches:
            stretches[-1].grants += 1
        if role in (Role.PREEMPTED.word, Role.PAUSED.word) and e.get("from") is not None:
            preemptions += 1
        if role == Role.DECODING.word and first_token is None:
            first_token = now - origin
        if role in ENDS:
            outcome = f"{role} ({e.get('rule')}) at {now - origin:.3f} s"
            break
        phase = PHASES.get(role or "", role or "?")
        if not stretches or stretches[-1].phase != phase:
            stretches.append(_Stretch(phase, now, now))
    head = f"request {request_id} (seq {seq}), arrived at t={events[0].get('t_s')} s " \
        f"(tick {events[0].get('tick')}); times from its arrival:"
    ttft = "no first token yet" if first_token is None else f"first token at {first_token:.3f} s"
    tail = f"  {ttft}; preempted {preemptions} time{'s' if preemptions != 1 else ''}; {outcome}"
    return "\n".join([head, *("  " + s.line(origin) for s in stretches), tail])
