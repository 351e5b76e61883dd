"""scripts/bench_chat_turns.py on a tiny layout against the real server it starts: what it
records per turn is what the server's prefix cache did (its timings are a benchmark, not a
test)."""

from __future__ import annotations

import json

from tests.scripts.conftest import run_script


def test_later_turns_prefill_their_new_tokens_only_with_the_cache(tmp_path):
    out = tmp_path / "turns.json"
    done = run_script("bench_chat_turns.py", "--conversations", "2", "--turns", "3",
                      "--user-tokens", "40", "--max-tokens", "4", "--repeats", "1",
                      "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    turns = report["turns"]
    assert len(turns) == 2 * 2 * 3  # phases x conversations x turns
    for row in turns:
        if row["phase"] == "cold" or row["turn"] == 1:
            assert row["cached_tokens"] == 0, row
        else:
            # The previous turn's prompt and answer came from the cache but the answer's last
            # token, whose KV was never written.
            assert row["prefilled_tokens"] == row["new_tokens"] + 1, row
    assert [e["turn"] for e in report["per_turn"]] == [1, 2, 3]
    assert "| 3 |" in done.stdout and "turns 2-3, cached:" in done.stdout
