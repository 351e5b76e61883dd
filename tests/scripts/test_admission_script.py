"""scripts/bench_mixed_step_admission.py against a real server on a small layout."""

from __future__ import annotations

import json
from collections import Counter

from tests.lifecycle_names import CHUNK_DONE
from tests.scripts.conftest import SMALL, run_script
from tests.server.http_helpers import get

SCRIPT = "bench_mixed_step_admission.py"


def test_small_run_prints_the_table(mixed_server):
    done = run_script(SCRIPT, "--url", mixed_server.url, *SMALL)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "policy mixed_step" in out
    for row in ("| TTFT admitted |", "| TTFT / TTFT alone |", "| admission p95 inflation |",
                "| first token before last stream token | yes |"):
        assert row in out, out


def trace(url: str) -> list[dict]:
    return [json.loads(line) for line in get(url, "/debug/trace").body.decode().splitlines()]


def test_json_reports_counters_that_fit_the_policy(mixed_server):
    before = len(trace(mixed_server.url))
    done = run_script(SCRIPT, "--url", mixed_server.url, *SMALL, "--streams", "2", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["comparable"] and report["policy"] == "mixed_step"
    # The prompt (measured alone, then admitted) is the sequence with the most chunks.
    chunks = Counter(e["seq"] for e in trace(mixed_server.url)[before:]
                     if e["trigger"] == CHUNK_DONE)
    assert report["prompt_chunks"] == report["prompt_chunks_while_streams_live"] == max(
        chunks.values())
    assert report["counters"]["fairtick_mixed_steps_total"] >= 1
    assert report["ttft_s"] > 0 and report["ttft_alone_s"] > 0
    assert len(report["quiet"]) == len(report["admission"]) == 2
    assert all(s["num_gaps"] >= 1 for s in report["admission"])
    assert report["p95_inflation"] > 0
    # The streams ran on for --post-s after the prompt's first token; their own p95 is the
    # larger of that window's and the quiet window's, and the ratios are against it.
    assert report["post_pooled"]["num_gaps"] >= 1
    own = report["own_p95_ms"]
    assert own == max(report["quiet_pooled"]["p95_ms"], report["post_pooled"]["p95_ms"])
    adm = report["admission_pooled"]
    assert report["max_over_own"] >= report["p99_over_own"] > 0
    assert abs(report["max_over_own"] * own - adm["max_ms"]) < 1e-6 * adm["max_ms"]
    assert report["work_conserving_limit"] >= 1
    assert report["prompt_cached_tokens"] == 0, "without a shared prefix no request uses the cache"


def test_a_shared_system_prompt_is_served_from_the_prefix_cache(mixed_server):
    done = run_script(SCRIPT, "--url", mixed_server.url, *SMALL, "--streams", "2",
                      "--shared-prefix-tokens", "64", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["shared_prefix_tokens"] == 64
    # BOS and the system prompt, which the warm-up left in the cache, at least.
    assert 64 + 1 <= report["prompt_cached_tokens"] < report["prompt_tokens"]


def test_a_shared_prefix_must_leave_room_for_the_prompt(mixed_server):
    done = run_script(SCRIPT, "--url", mixed_server.url, *SMALL, "--shared-prefix-tokens", "199")
    assert done.returncode == 2 and "shared_prefix_tokens: invalid value 199" in done.stderr


def test_refuses_streams_too_short_to_straddle_the_admission(mixed_server):
    short = [*SMALL, "--stream-tokens", "3"]  # 3 ticks: over long before the half-second settle
    done = run_script(SCRIPT, "--url", mixed_server.url, *short)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.startswith("NOT COMPARABLE: "), done.stdout
    assert "straddle" in done.stdout and "--stream-tokens" in done.stdout


def test_refuses_streams_that_end_before_the_window_after_the_first_token(mixed_server):
    # 1,500 stream tokens outlast the half-second quiet window and the 200-token prompt's 13
    # chunks (at 1 ms a decode step, 1.5 s; 400 tokens ended before the prompt's first token on
    # a fast machine), but not 60 s of decoding after its first token (at 30 ms a step, 45 s):
    # they reach max_tokens inside the window after it.
    args = [*SMALL, "--stream-tokens", "1500", "--post-s", "60", "--streams", "2",
            "--timeout-s", "120"]
    done = run_script(SCRIPT, "--url", mixed_server.url, *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "did not outlast the prompt" in done.stdout, done.stdout


def test_refuses_when_no_slot_is_left_for_the_prompt(mixed_server):
    done = run_script(SCRIPT, "--url", mixed_server.url, *SMALL, "--streams", "5", "--json")
    assert done.returncode == 2
    assert json.loads(done.stdout) == {
        "comparable": False,
        "reason": "the server runs at most 5 sequences: 5 streams and the prompt need 6 "
                  "(--max-running)"}


def test_unreachable_server_is_an_error_not_a_verdict():
    done = run_script(SCRIPT, "--url", "http://127.0.0.1:9", *SMALL)
    assert done.returncode == 1 and "cannot reach" in done.stderr
