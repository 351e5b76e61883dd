"""scripts/bench_memory_pressure.py on a small budget: its verdict is the engine's, read back
through the real server's texts, /metrics, /debug/trace and 429s."""

from __future__ import annotations

import json

from tests.scripts.conftest import run_script


def test_a_waiting_limit_below_the_requests_is_refused(tmp_path):
    done = run_script("bench_memory_pressure.py", "--max-tokens", "5,5,5", "--max-waiting", "2",
                      "--out", str(tmp_path))
    assert done.returncode == 2 and "at least their number, 3" in done.stderr, done.stderr


def test_a_tight_budget_loses_nothing_and_the_script_shows_it(tmp_path):
    # 4 requests of 60-150 tokens through 240 KV tokens: they cannot all hold their KV at once.
    done = run_script("bench_memory_pressure.py", "--max-kv-tokens", "240",
                      "--max-tokens", "60,90,120,150",
                      "--out", str(tmp_path), timeout_s=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "verdict: nothing lost" in done.stdout
    report = json.loads((tmp_path / "memory-pressure.json").read_text())
    free, tight = report["unconstrained"], report["budget"]
    assert [c["text"] for c in tight["completions"]] == [c["text"] for c in free["completions"]]
    assert [c["tokens"] for c in tight["completions"]] == [60, 90, 120, 150]
    assert tight["kv_budget_tokens"] == 240 and free["kv_budget_tokens"] > 240
    assert sum(tight["preemptions"].values()) >= 1 and not sum(free["preemptions"].values())
    assert tight["trace_events"], "preemptions are visible in the trace"
    busy = report["past_waiting_limit"]
    assert busy["statuses"].get("429", 0) >= 1
    assert busy["429_with_retry_after"] == busy["statuses"]["429"]
