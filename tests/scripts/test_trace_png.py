"""`fairtick trace --png`: the trace picture, from a real server and from `fairtick check`
output. The pictures are read back (tests/scripts/conftest.py `png_lanes`): one lane per
sequence, top to bottom in sequence order, its bars in the order of the states it went through.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from server.cli import main as fairtick
from server.trace_png import MAX_LANES, Span, lane_spans
from statemachine.lifecycle import DEFAULT_LIFECYCLE
from tests.lifecycle_names import (
    ADMIT,
    CHUNK_DONE,
    DECODING,
    FINISH,
    FINISHED,
    GRANT,
    PARKED,
    PAUSE,
    PAUSED,
    PREEMPT,
    PREEMPTED,
    PREFILLING,
    READMIT,
    RESUME,
    WAITING,
)
from tests.scripts.conftest import png_bars, png_lanes, png_size
from tests.server.http_helpers import get, post


def wrote(out: str) -> tuple[int, int]:
    """The size `fairtick trace --png` says it wrote."""
    match = re.search(r"wrote \S+ \((\d+)x(\d+), \d+ events\)", out)
    assert match, out
    return int(match[1]), int(match[2])


def merged(states: list[str]) -> list[str]:
    """Back-to-back spans of one state are one bar in the picture."""
    return [s for i, s in enumerate(states) if i == 0 or states[i - 1] != s]


def timed_trace(path: Path, moves: list[tuple[float, int, int, str | None, str, str]]) -> Path:
    """A server trace at `path` (JSON lines): one event per (seconds, tick, seq, from, to,
    trigger), an arrival where `from` is None."""
    path.write_text("".join(json.dumps(
        {"tick": tick, "time": 1e9 + t, "t_s": t, "seq": seq, "kind": "arrival" if a is None
         else "transition", "from": a, "to": b, "trigger": trig, "rule": "r"}) + "\n"
        for t, tick, seq, a, b, trig in moves))
    return path


def test_png_of_a_real_trace(mixed_server, tmp_path, capsys):
    for prompt in ("p" * 40, "q" * 20):  # two sequences, several chunks each
        assert post(mixed_server.url, "/v1/completions",
                    {"prompt": prompt, "max_tokens": 4}).status == 200
    text = get(mixed_server.url, "/debug/trace").body.decode()
    trace = [json.loads(line) for line in text.splitlines()]
    png = tmp_path / "trace.png"
    assert fairtick(["trace", "--url", mixed_server.url, "--png", str(png), "--ticks"]) == 0
    assert wrote(capsys.readouterr().out) == png_size(png)
    seqs = sorted({e["seq"] for e in trace if e["seq"] is not None})
    assert len(seqs) == 2
    expected = [merged([s.state for s in lane_spans(trace) if s.seq == seq]) for seq in seqs]
    assert png_lanes(png) == expected
    for lane in expected:  # each ran its chunks, decoded and finished
        assert lane[-3:] == [PREFILLING, DECODING, FINISHED], lane
    # By default, in seconds: the same two lanes, each ending decoded and finished.
    timed = tmp_path / "timed.png"
    assert fairtick(["trace", "--url", mixed_server.url, "--png", str(timed)]) == 0
    assert "seconds" not in capsys.readouterr().err
    lanes = png_lanes(timed)
    assert len(lanes) == 2 and all(lane[-2:] == [DECODING, FINISHED] for lane in lanes), lanes


def test_png_widths_are_seconds(tmp_path):
    # seq 0: waiting 1.0 s, parked 0.5 s, prefilling 2.0 s, decoding 0.5 s; by tick, the
    # prefilling bar is one tick and waiting none.
    moves = [(0.0, 0, 0, None, WAITING, "arrive"), (1.0, 0, 0, WAITING, PARKED, ADMIT),
             (1.5, 1, 0, PARKED, PREFILLING, GRANT), (3.5, 1, 0, PREFILLING, DECODING, CHUNK_DONE),
             (4.0, 9, 0, DECODING, FINISHED, FINISH)]
    source = timed_trace(tmp_path / "timed.jsonl", moves)
    png = tmp_path / "timed.png"
    assert fairtick(["trace", "--file", str(source), "--png", str(png)]) == 0
    [lane] = png_bars(png)
    assert [state for state, _ in lane] == [WAITING, PARKED, PREFILLING, DECODING, FINISHED]
    width = dict(lane)
    assert width[PREFILLING] / width[PARKED] == pytest.approx(4, rel=0.1)
    assert width[WAITING] / width[PARKED] == pytest.approx(2, rel=0.1)
    assert width[DECODING] / width[PARKED] == pytest.approx(1, rel=0.1)
    by_tick = tmp_path / "ticks.png"
    assert fairtick(["trace", "--file", str(source), "--png", str(by_tick), "--ticks"]) == 0
    assert png_lanes(by_tick) == [[PARKED, PREFILLING, DECODING, FINISHED]]


def test_a_short_bar_is_drawn_whole_wherever_a_grid_line_falls(tmp_path):
    # A finished bar is a few pixels wide; grid lines drawn over the bars cut one into pieces
    # too small to show where a line crossed it (the finished bar of a real trace went missing
    # from the picture). The same bar, finishing a little later each time, keeps its width.
    widths = []
    for i in range(21):
        finish = 3.0 + i / 10
        moves = [(0.0, 0, 0, None, WAITING, "arrive"), (0.5, 0, 0, WAITING, PARKED, ADMIT),
                 (1.0, 1, 0, PARKED, PREFILLING, GRANT),
                 (2.0, 1, 0, PREFILLING, DECODING, CHUNK_DONE),
                 (finish, 9, 0, DECODING, FINISHED, FINISH)]
        source = timed_trace(tmp_path / f"timed{i}.jsonl", moves)
        png = tmp_path / f"timed{i}.png"
        assert fairtick(["trace", "--file", str(source), "--png", str(png)]) == 0
        [lane] = png_bars(png)
        assert [state for state, _ in lane][-2:] == [DECODING, FINISHED]
        widths.append(lane[-1][1])
    assert max(widths) - min(widths) <= 1, widths


def test_png_of_a_check_counterexample(tmp_path):
    # The shape of `fairtick check` output: numbered steps, then indented JSON lines.
    lines = ["-- counterexample for no_starvation: seq 1 parked", "     1. seq 0 arrives",
             "     3. tick 0: prefill (rule prefill_when_idle) granted [0]",
             "     9. tick 7: decode (rule decode_first)", "   trace (JSON lines):"]
    events = [(0, WAITING, PARKED, ADMIT, 0), (0, WAITING, PARKED, ADMIT, 1),
              (0, PARKED, PREFILLING, GRANT, 0), (0, PREFILLING, DECODING, CHUNK_DONE, 0)]
    lines += ["   " + json.dumps({"tick": t, "time": None, "seq": s, "from": a, "to": b,
                                  "trigger": trig, "rule": "r"}) for t, a, b, trig, s in events]
    source = tmp_path / "check.txt"
    source.write_text("\n".join(lines) + "\n")
    png = tmp_path / "check.png"
    assert fairtick(["trace", "--file", str(source), "--png", str(png)]) == 0
    # seq 0 was granted its only chunk in tick 0 and decodes from tick 1; seq 1 stays parked.
    assert png_lanes(png) == [[PREFILLING, DECODING], [PARKED]]


def test_png_draws_the_most_recent_sequences_when_there_are_too_many(tmp_path):
    num = MAX_LANES + 3
    events = [{"tick": seq, "seq": seq, "to": PARKED if seq % 2 else DECODING, "trigger": ADMIT}
              for seq in range(num)]
    source = tmp_path / "many.jsonl"
    source.write_text("".join(json.dumps(e) + "\n" for e in events))
    png = tmp_path / "many.png"
    assert fairtick(["trace", "--file", str(source), "--png", str(png)]) == 0
    shown = range(num - MAX_LANES, num)  # the last MAX_LANES sequences, first one on top
    assert png_lanes(png) == [[PARKED if seq % 2 else DECODING] for seq in shown]


def test_lanes_follow_tick_semantics():
    events = [{"tick": 3, "seq": 7, "to": PARKED, "trigger": ADMIT},
              {"tick": 5, "seq": 7, "to": PREFILLING, "trigger": GRANT},
              {"tick": 5, "seq": 7, "to": DECODING, "trigger": CHUNK_DONE},
              {"tick": 9, "seq": 7, "to": FINISHED, "trigger": FINISH}]
    assert lane_spans(events, end_tick=20) == [
        Span(7, PARKED, 3, 5), Span(7, PREFILLING, 5, 6),
        Span(7, DECODING, 6, 10), Span(7, FINISHED, 10, 11)]


def test_png_draws_paused_and_preempted_lanes(tmp_path):
    # Every role has a colour: a preempted and a paused sequence show as such, not as gaps.
    events = [(0, WAITING, PARKED, ADMIT, 0), (0, WAITING, PARKED, ADMIT, 1),
              (0, PARKED, PREFILLING, GRANT, 0), (0, PREFILLING, DECODING, CHUNK_DONE, 0),
              (1, PARKED, PREFILLING, GRANT, 1), (1, PREFILLING, DECODING, CHUNK_DONE, 1),
              (4, DECODING, PAUSED, PAUSE, 0), (6, PAUSED, DECODING, RESUME, 0),
              (5, DECODING, PREEMPTED, PREEMPT, 1), (8, PREEMPTED, PARKED, READMIT, 1)]
    source = tmp_path / "trace.jsonl"
    source.write_text("".join(json.dumps({"tick": t, "time": None, "seq": s, "from": a, "to": b,
                                          "trigger": trig, "rule": "r"}) + "\n"
                              for t, a, b, trig, s in sorted(events, key=lambda e: e[0])))
    png = tmp_path / "trace.png"
    assert fairtick(["trace", "--file", str(source), "--png", str(png)]) == 0
    assert png_lanes(png) == [[PREFILLING, DECODING, PAUSED, DECODING],
                              [PARKED, PREFILLING, DECODING, PREEMPTED, PARKED]]


def test_png_of_a_renamed_lifecycle_colours_its_states_by_role(tmp_path, capsys):
    # A server run with renamed states (only the trace's words change) made --png fail with a
    # traceback: no state had a colour, and the empty legend raised. --lifecycle names the file
    # the trace ran under; without it, states the default file does not name get colours of
    # their own.
    doc = yaml.safe_load(DEFAULT_LIFECYCLE.read_text())
    new = {name: f"zz_{name}" for name in doc["states"]}

    def one(x):
        return [new[s] for s in x] if isinstance(x, list) else new[x]

    doc = {**doc, "states": {new[k]: v for k, v in doc["states"].items()},
           "transitions": [{**t, "source": one(t["source"]), "dest": one(t["dest"])}
                           for t in doc["transitions"]]}
    life = tmp_path / "renamed.yaml"
    life.write_text(yaml.safe_dump(doc, sort_keys=False))
    events = [(0, WAITING, PARKED, ADMIT, 0), (0, WAITING, PARKED, ADMIT, 1),
              (0, PARKED, PREFILLING, GRANT, 0), (0, PREFILLING, DECODING, CHUNK_DONE, 0)]
    source = tmp_path / "trace.jsonl"
    source.write_text("".join(json.dumps({"tick": t, "time": None, "seq": s, "from": new[a],
                                          "to": new[b], "trigger": trig, "rule": "r"}) + "\n"
                              for t, a, b, trig, s in events))
    png = tmp_path / "renamed.png"
    assert fairtick(["trace", "--file", str(source), "--png", str(png),
                     "--lifecycle", str(life)]) == 0
    assert png_lanes(png) == [[PREFILLING, DECODING], [PARKED]]  # drawn in their roles' colours
    other = tmp_path / "default.png"
    assert fairtick(["trace", "--file", str(source), "--png", str(other)]) == 0
    assert "wrote" in capsys.readouterr().out and other.stat().st_size > 0
