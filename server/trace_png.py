"""A picture of a scheduler trace: one lane per sequence, coloured by lifecycle state, so a
starvation (a long parked lane beside decoding ones) or its absence shows at a glance. The x
axis is seconds since the server started (a 0.4 s prefill chunk is as wide as 130 decode steps
of 3 ms), or ticks on request and for traces without times (`fairtick check` output). Reads
the JSON lines of /debug/trace or of `fairtick check` (whose counterexamples print them
indented among other text). The legend shows the states drawn.
"""

from __future__ import annotations

import json
import re
import sys
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from statemachine.lifecycle import Lifecycle, Role, Trigger, load_lifecycle

ROLE_COLOURS = {
    Role.QUEUED: "#bdbdbd",
    Role.PARKED: "#e6550d",
    Role.PREFILLING: "#3182bd",
    Role.DECODING: "#31a354",
    Role.PAUSED: "#9e9ac8",
    Role.PREEMPTED: "#fdd0a2",
    Role.FINISHED: "#252525",
    Role.ABORTED: "#de2d26",
}
TERMINAL_ROLES = (Role.FINISHED, Role.ABORTED)
# For a state the lifecycle given does not name (a trace of a server that ran another one).
OTHER_COLOURS = ("#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f", "#9467bd")
# Triggers recorded after the tick's work: the new state begins with the next tick.
AFTER_WORK = (Trigger.CHUNK_DONE.value, Trigger.FINISH.value)
WIDTH_PX, DPI, MAX_LANES, LEGEND_PX = 1200, 100, 64, 30
# A step line of a `fairtick check` counterexample: "  12. tick 9: decode (rule ...)".
CHECK_STEP = re.compile(r"^\s*\d+\. tick (\d+):", re.MULTILINE)


@dataclass(frozen=True)
class Span:
    """`seq` was in `state` during [start, end): ticks, or seconds since the server started."""

    seq: int
    state: str
    start: float
    end: float


def parse_trace_lines(text: str) -> list[list[dict[str, Any]]]:
    """The traces in `text`: runs of JSON-object lines with a tick and a seq; a new trace
    starts where the tick goes back (several counterexamples in one `fairtick check` output)."""
    traces: list[list[dict[str, Any]]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(event, dict) or not {"tick", "seq", "to"} <= set(event) or \
                isinstance(event["tick"], bool) or not isinstance(event["tick"], int):
            continue
        if not traces or event["tick"] < traces[-1][-1]["tick"]:
            traces.append([])
        traces[-1].append(event)
    return traces


def state_colours(life: Lifecycle | None = None) -> dict[str, str]:
    """The colour of each state of `life` (default: specs/lifecycle.yaml), by its role."""
    life = life or load_lifecycle()
    return {life.state_of[role]: colour for role, colour in ROLE_COLOURS.items()
            if life.has(role)}


def has_times(events: Iterable[dict[str, Any]]) -> bool:
    """Whether every event has its seconds since the server started (server traces do)."""
    return all(e.get("t_s") is not None for e in _moves(events))


def time_spans(events: Iterable[dict[str, Any]], life: Lifecycle | None = None) -> list[Span]:
    """The state spans of every sequence in seconds since the server started; a live one's
    last span runs to the latest event, a terminal state is drawn 1/200 of the whole wide."""
    life = life or load_lifecycle()
    terminal = {life.state_of[r] for r in TERMINAL_ROLES if life.has(r)}
    by_seq: dict[int, list[dict[str, Any]]] = {}
    for e in _moves(events):
        by_seq.setdefault(int(e["seq"]), []).append(e)
    times = [e["t_s"] for evs in by_seq.values() for e in evs]
    first, last = min(times, default=0.0), max(times, default=0.0)
    mark = max(last - first, 1e-3) / 200
    spans = []
    for seq, evs in sorted(by_seq.items()):
        for i, e in enumerate(evs):
            start = e["t_s"]
            stop = evs[i + 1]["t_s"] if i + 1 < len(evs) else last
            if e["to"] in terminal:
                stop = start + mark
            if stop > start:
                spans.append(Span(seq, e["to"], start, stop))
    return spans


def _moves(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    # What changes a lane: arrivals and transitions (waits and refusals do not).
    return [e for e in events if e.get("seq") is not None
            and e.get("kind", "transition") in ("transition", "arrival")]


def lane_spans(events: Iterable[dict[str, Any]], end_tick: int | None = None,
               life: Lifecycle | None = None) -> list[Span]:
    """The state spans of every sequence in ticks; a live one's last span runs to `end_tick`
    (default: one past the last event), a terminal state is one tick wide."""
    life = life or load_lifecycle()
    terminal = {life.state_of[r] for r in TERMINAL_ROLES if life.has(r)}
    by_seq: dict[int, list[dict[str, Any]]] = {}
    for e in _moves(events):
        by_seq.setdefault(int(e["seq"]), []).append(e)
    starts = {seq: [e["tick"] + (e["trigger"] in AFTER_WORK) for e in evs]
              for seq, evs in by_seq.items()}
    last = max((t for ts in starts.values() for t in ts), default=0) + 1
    end = max(last, end_tick or 0)
    spans = []
    for seq, evs in sorted(by_seq.items()):
        ticks = starts[seq]
        for i, e in enumerate(evs):
            stop = ticks[i + 1] if i + 1 < len(evs) else end
            if e["to"] in terminal:
                stop = ticks[i] + 1
            if stop > ticks[i]:
                spans.append(Span(seq, e["to"], ticks[i], stop))
    return spans


def figure_size_px(num_lanes: int) -> tuple[int, int]:
    """(width, height) of the picture for this many lanes."""
    lanes = min(max(num_lanes, 1), MAX_LANES)
    return WIDTH_PX, min(200 + 28 * lanes, 2000)


def render_png(events: list[dict[str, Any]], path: str | Path, title: str | None = None,
               end_tick: int | None = None, by_tick: bool = False,
               life: Lifecycle | None = None) -> tuple[int, int]:
    """Draw `events` to a PNG at `path` (x axis in seconds, or in ticks with `by_tick` or when
    the events have no times), states coloured by their role in `life` (default:
    specs/lifecycle.yaml; a state it does not name gets a colour of its own); returns its
    (width, height) in pixels. With more than MAX_LANES sequences, the most recent ones are
    drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    by_tick = by_tick or not has_times(events)
    spans = lane_spans(events, end_tick, life) if by_tick else time_spans(events, life)
    drawn = {s.state for s in spans}
    colours = {state: c for state, c in state_colours(life).items() if state in drawn}
    colours.update({state: OTHER_COLOURS[i % len(OTHER_COLOURS)]
                    for i, state in enumerate(sorted(drawn - set(colours)))})
    seqs = sorted({s.seq for s in spans})
    shown = seqs[-MAX_LANES:]
    lane_of = {seq: i for i, seq in enumerate(reversed(shown))}  # first sequence on top
    width, height = figure_size_px(len(shown))
    fig, ax = plt.subplots(figsize=(width / DPI, height / DPI), dpi=DPI)
    ends = [t for s in spans for t in (s.start, s.end)]
    # A stretch too short for the picture still shows, a few pixels wide (8 of the figure's
    # width, ~6 of the axes', so it keeps whole pixels of its colour whatever its sub-pixel
    # position): every state in the legend is drawn.
    least = (max(ends, default=1) - min(ends, default=0)) * 8 / WIDTH_PX
    for state, colour in colours.items():
        for seq in shown:
            bars = [(s.start, max(s.end - s.start, least)) for s in spans
                    if s.seq == seq and s.state == state]
            if bars:
                ax.broken_barh(bars, (lane_of[seq] - 0.4, 0.8), facecolors=colour)
    ax.set_yticks(range(len(shown)), [f"seq {seq}" for seq in reversed(shown)],
                  fontsize=8 if len(shown) < 30 else 6)
    ax.set_ylim(-0.6, len(shown) - 0.4)
    ax.set_xlabel("tick" if by_tick else "seconds since the server started")
    ax.set_xlim(min(ends, default=0), max(ends, default=1) + least)
    hidden = f" ({len(seqs) - len(shown)} older sequences not shown)" if len(seqs) > MAX_LANES \
        else ""
    ax.set_title((title or f"fairtick trace: {len(seqs)} sequences") + hidden, fontsize=10)
    ax.xaxis.set_major_locator(MaxNLocator(integer=by_tick))
    # Grid lines behind the bars: over a bar a few pixels wide, one cut it into pieces too
    # small to see (and to read back: the finished bar went missing from a test's picture).
    ax.set_axisbelow(True)
    ax.grid(True, axis="x", alpha=0.3)
    fig.legend(handles=[Patch(facecolor=c, label=s) for s, c in colours.items()],
               loc="lower center", ncol=len(colours), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, LEGEND_PX / height, 1, 1))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return width, height


def read_trace_file(path: str, since: int = 0, limit: int | None = None) -> str | None:
    """The first trace in a file as JSON lines, from tick `since`, at most `limit` events;
    None (after saying why) if the file cannot be read or holds no trace event."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        print(f"fairtick trace: cannot read {path}: {exc}", file=sys.stderr)
        return None
    traces = parse_trace_lines(text)
    if not traces:  # a wrong file printed an empty table and exited 0
        print(f"fairtick trace: no trace events in {path}: expected the JSON lines of "
              "/debug/trace (`fairtick trace --json`) or `fairtick check` output, each an "
              "object with an integer tick, a seq and a to", file=sys.stderr)
        return None
    if len(traces) > 1:
        print(f"fairtick trace: {len(traces)} traces in {path}; using the first",
              file=sys.stderr)
    events = [e for e in (traces[0] if traces else []) if e["tick"] >= since]
    events = events[-limit:] if limit is not None else events
    return "".join(json.dumps(e) + "\n" for e in events)


def trace_end_tick(file: str | None, url: str) -> int | None:
    """Where live lanes end: one past the last tick of a `fairtick check` counterexample in
    `file` (its JSON lines stop at the last transition), else the server's tick now."""
    if file is not None:
        try:
            ticks = [int(t) for t in CHECK_STEP.findall(Path(file).read_text(errors="replace"))]
        except OSError:
            return None
        return max(ticks) + 1 if ticks else None
    return current_tick(url)


def current_tick(url: str) -> int | None:
    """The server's tick now, or None if it cannot be read."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/debug/state", timeout=10) as response:
            return int(json.loads(response.read())["tick"])
    except (OSError, ValueError, KeyError):
        return None


def write_trace_png(text: str, png: str, source: str, end_tick: int | None = None,
                    by_tick: bool = False, life: Lifecycle | None = None) -> int:
    """`fairtick trace --png`: draw the first trace in `text` (`life`: the lifecycle it ran
    under); the exit status."""
    traces = parse_trace_lines(text)
    if not traces:
        print(f"fairtick trace: no trace events in {source}", file=sys.stderr)
        return 1
    events = traces[0]
    last = max(end_tick or 0, max(e["tick"] for e in events))
    title = f"fairtick trace of {source}: {len({e['seq'] for e in events})} sequences, " \
        f"ticks {events[0]['tick']}..{last}"
    width, height = render_png(events, png, title, end_tick, by_tick, life)
    print(f"wrote {png} ({width}x{height}, {len(events)} events)")
    return 0
