"""The long-run benchmark (scripts/bench_long_run.py): its gap arithmetic, its options, and a
few seconds of it against a real server."""

from __future__ import annotations

import json
import math

import pytest
from bench_long_run import parse_args
from benchlib.long_run import TailStats, classify_gaps, over, worst
from benchlib.windows import Window

from tests.scripts.conftest import run_script


def test_a_gap_is_a_prompts_when_it_overlaps_the_prompts_wait():
    streams = [[10.0, 10.1, 10.2, 10.9, 11.0], [10.05, 10.5]]
    gaps = classify_gaps(streams, [Window(10.25, 10.8)], t0_s=10.0)
    assert [(round(g.start_s, 2), round(g.ms), g.during_prompt) for g in gaps] == [
        (0.0, 100, False), (0.1, 100, False),  # before the prompt was sent
        (0.2, 700, True),  # spans the prompt's wait
        (0.9, 100, False),  # after its first token
        (0.05, 450, True)]  # the other stream's, overlapping it
    assert [round(g.ms) for g in worst(gaps, 2)] == [700, 450]
    assert over(gaps, 100.5) == 2


def test_tail_stats_reach_the_worst_gap():
    gaps = classify_gaps([[0.001 * i for i in range(1001)] + [2.0]], [], t0_s=0.0)
    stats = TailStats.of(gaps)
    assert stats.num_gaps == 1001
    assert stats.p50_ms == pytest.approx(1.0) and stats.p99_ms == pytest.approx(1.0)
    assert stats.max_ms == pytest.approx(1000.0)
    assert stats.max_over_p95 == pytest.approx(1000.0)
    assert 1.0 < stats.p999_ms < 1000.0  # interpolated towards the one long gap
    assert math.isnan(TailStats.of([]).p95_ms)


@pytest.mark.parametrize("flag, value, message", [
    ("--duration-s", "0", "--duration-s must be positive"),
    ("--streams", "-1", "--streams must be positive"),
    ("--prompt-every-s", "-5", "--prompt-every-s must be 0"),
])
def test_bad_options_are_named(capsys, flag, value, message):
    with pytest.raises(SystemExit):
        parse_args([flag, value])
    assert message in capsys.readouterr().err


def test_a_short_run_against_a_server(mixed_server, tmp_path):
    out = tmp_path / "long.json"
    done = run_script("bench_long_run.py", "--url", mixed_server.url, "--duration-s", "4",
                      "--streams", "2", "--stream-tokens", "150", "--prompt-every-s", "2",
                      "--prompt-tokens", "120", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["errors"] == []
    assert result["gaps"]["all"]["num_gaps"] == (result["gaps"]["own"]["num_gaps"]
                                                 + result["gaps"]["beside a prompt"]["num_gaps"])
    assert result["gaps"]["own"]["num_gaps"] > 0
    assert len(result["ttft_s"]) == 2  # at 1 s and 3 s
    assert len(result["gc_collections"]) == 3
    assert "| own |" in done.stdout and "worst gaps" in done.stdout
