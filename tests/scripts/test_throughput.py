"""The throughput benchmark's arithmetic and options (scripts/bench_throughput.py); its timed
runs are a benchmark, not a test."""

from __future__ import annotations

import math

import pytest
from bench_throughput import parse_args
from benchlib.throughput import Comparison, arm_order, format_table, token_window, window_rate
from benchlib.windows import Window


def test_window_rate_counts_only_the_tokens_inside_the_window():
    streams = [
        [0.5, 1.0, 1.5, 2.0, 2.5, 3.5],  # 2 tokens before [1.2, 3.2), 3 inside, 1 after
        [0.1, 3.0],  # 1 before, 1 inside
        [5.0],  # none inside: not decoding in the window
        [],  # never started (queued)
    ]
    rate = window_rate(streams, Window(1.2, 3.2))
    assert rate.tokens == 4 and rate.active_streams == 2
    assert rate.tokens_per_s == pytest.approx(4 / 2.0)
    assert rate.tokens_before == pytest.approx((2 + 1) / 2)
    # Gaps wholly inside: 1.5->2.0 and 2.0->2.5 of the first stream; 0.1->3.0 starts outside.
    assert rate.gaps.num_gaps == 2 and rate.gaps.max_ms == pytest.approx(500)


def test_an_empty_window_has_no_tokens_and_no_gaps():
    rate = window_rate([[0.1], [9.0]], Window(1.0, 2.0))
    assert rate.tokens == 0 and rate.active_streams == 0
    assert math.isnan(rate.gaps.p95_ms)


def test_the_token_window_spans_the_same_token_indices_of_every_stream():
    streams = [
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
        [0.5, 1.5, 2.5, 3.5, 4.5],  # the later stream: it sets the window's opening
    ]
    # Opens when both have their 2nd token (1.5), closes when the first has its 5th (4.0).
    assert token_window(streams, 2, 5) == Window(1.5, 4.0)
    rate = window_rate(streams, token_window(streams, 2, 5))
    assert rate.tokens == 5  # 2.0, 3.0 and 1.5, 2.5, 3.5: 4.0 closes the window
    assert rate.tokens_before == pytest.approx((2 + 1) / 2)


def test_streams_too_far_apart_have_no_token_window():
    # The second stream's 1st token comes after the first stream's 3rd: no common window.
    assert token_window([[0.0, 1.0, 2.0], [2.5, 3.0, 3.5]], 1, 3) is None


def test_the_token_window_needs_its_tokens_and_an_order():
    with pytest.raises(ValueError, match="every stream needs 3"):
        token_window([[0.0, 1.0, 2.0], [0.0, 1.0]], 1, 3)
    for first, last in ((0, 2), (2, 2), (3, 2)):
        with pytest.raises(ValueError, match="0 < first < last"):
            token_window([[0.0, 1.0, 2.0]], first, last)


def test_arms_alternate_which_runs_first():
    assert arm_order(["a", "b"], 0) == ["a", "b"]
    assert arm_order(["a", "b"], 1) == ["b", "a"]
    assert arm_order(["a", "b"], 2) == ["a", "b"]


def test_the_table_puts_each_ratio_beside_its_goal():
    row = Comparison(streams=4, fairtick_tok_s=300.0, mlx_lm_tok_s=100.0, bare_tok_s=400.0,
                     bare_rows=4)
    assert row.vs_mlx_lm == pytest.approx(3.0) and row.vs_bare == pytest.approx(0.75)
    table = format_table([row], 2.0, 0.9)
    assert "(goal >= 2)" in table and "(goal >= 0.9)" in table
    assert "| 4 | 300 | 100 | 3.00 | 400 (4) | 0.75 |" in table


def test_a_missing_arm_gives_an_undefined_ratio_not_an_error():
    row = Comparison(16, 300.0, 0.0, math.nan, 0)
    assert math.isnan(row.vs_mlx_lm) and math.isnan(row.vs_bare)


def test_options_are_parsed_and_checked(capsys):
    args = parse_args(["--streams", "4,16", "--fairtick-flags",
                       "--max-running 16 --policy deadline"])
    assert args.streams == [4, 16]
    assert args.fairtick_flags == ["--max-running", "16", "--policy", "deadline"]
    for bad, named in ((["--streams", "4,x"], "--streams"), (["--streams", "0"], "--streams"),
                       (["--to-token", "100"], "--to-token"),  # not after --from-token
                       (["--to-token", "9000"], "--max-tokens"),  # past max_tokens
                       (["--timeout-s", "0"], "--timeout-s"), (["--rounds", "0"], "--rounds")):
        with pytest.raises(SystemExit) as exc:
            parse_args(bad)
        assert exc.value.code == 2
        assert named in capsys.readouterr().err
