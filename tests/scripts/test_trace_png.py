"""`fairtick trace --png`: the trace picture, from a real server and from `fairtick check`
output."""

from __future__ import annotations

import json

from server.cli import main as fairtick
from server.trace_png import Span, figure_size_px, lane_spans
from tests.scripts.conftest import png_size
from tests.server.http_helpers import get, post


def test_png_of_a_real_trace(mixed_server, tmp_path, capsys):
    for prompt in ("p" * 40, "q" * 20):  # two sequences, several chunks each
        assert post(mixed_server.url, "/v1/completions",
                    {"prompt": prompt, "max_tokens": 4}).status == 200
    text = get(mixed_server.url, "/debug/trace").body.decode()
    trace = [json.loads(line) for line in text.splitlines()]
    png = tmp_path / "trace.png"
    assert fairtick(["trace", "--url", mixed_server.url, "--png", str(png)]) == 0
    assert png_size(png) == figure_size_px(len({e["seq"] for e in trace}))
    assert f"wrote {png}" in capsys.readouterr().out


def test_png_of_a_check_counterexample(tmp_path):
    # The shape of `fairtick check` output: numbered steps, then indented JSON lines.
    lines = ["-- counterexample for no_starvation: seq 1 parked", "     1. seq 0 arrives",
             "     3. tick 0: prefill (rule prefill_when_idle) granted [0]",
             "     9. tick 7: decode (rule decode_first)", "   trace (JSON lines):"]
    events = [(0, "waiting", "parked_prefill", "admit", 0), (0, "waiting", "parked_prefill",
              "admit", 1), (0, "parked_prefill", "prefilling", "grant", 0),
              (0, "prefilling", "decoding", "chunk_done", 0)]
    lines += ["   " + json.dumps({"tick": t, "time": None, "seq": s, "from": a, "to": b,
                                  "trigger": trig, "rule": "r"}) for t, a, b, trig, s in events]
    source = tmp_path / "check.txt"
    source.write_text("\n".join(lines) + "\n")
    png = tmp_path / "check.png"
    assert fairtick(["trace", "--file", str(source), "--png", str(png)]) == 0
    assert png_size(png) == figure_size_px(2)


def test_lanes_follow_tick_semantics():
    events = [{"tick": 3, "seq": 7, "to": "parked_prefill", "trigger": "admit"},
              {"tick": 5, "seq": 7, "to": "prefilling", "trigger": "grant"},
              {"tick": 5, "seq": 7, "to": "decoding", "trigger": "chunk_done"},
              {"tick": 9, "seq": 7, "to": "finished", "trigger": "finish"}]
    assert lane_spans(events, end_tick=20) == [
        Span(7, "parked_prefill", 3, 5), Span(7, "prefilling", 5, 6),
        Span(7, "decoding", 6, 10), Span(7, "finished", 10, 11)]
