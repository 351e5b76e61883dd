"""TTFT of a repeated long prompt and of a chat's second turn: served from the prefix cache, and
cold (the same request with `"cache_prompt": false`), side by side in one run against a real
`fairtick serve` at its default flags.

    python scripts/bench_prefix_chat.py --prefix-tokens 4000 --rounds 5

Each round: turn 1 (a system prompt of `--prefix-tokens` characters, one token each on the
built-in model, and a question); turn 1 again (the repeated prompt: all but its last token
cached); then turn 2 (turn 1, its answer and a new question) twice: cached, then cold. Prints
every TTFT, their p50 / p95 / p99 / worst, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib.chat import load_average, make_text, summary, timed_chat  # noqa: E402
from benchlib.serve import start_server, stop_server  # noqa: E402
from openai import OpenAI  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix-tokens", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    log = Path(tempfile.mkdtemp()) / "serve.log"
    print(f"load average before: {load_average()}", flush=True)
    server = start_server([], log)
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                        timeout=600)
        model = client.models.list().data[0].id
        first_s, again_s, cached_s, cold_s = [], [], [], []
        for r in range(args.rounds):
            turn1 = [{"role": "system", "content": make_text(args.prefix_tokens, r)},
                     {"role": "user", "content": "What comes first?"}]
            first = timed_chat(client, model, turn1, args.max_tokens, cache=True)
            again = timed_chat(client, model, turn1, args.max_tokens, cache=True)
            turn2 = turn1 + [{"role": "assistant", "content": first.text},
                             {"role": "user", "content": "And then?"}]
            hit = timed_chat(client, model, turn2, args.max_tokens, cache=True)
            cold = timed_chat(client, model, turn2, args.max_tokens, cache=False)
            assert again.text == first.text, "greedy output must not depend on the cache"
            assert hit.text == cold.text, "greedy output must not depend on the cache"
            for samples, timing in ((first_s, first), (again_s, again), (cached_s, hit),
                                    (cold_s, cold)):
                samples.append(timing.ttft_s)
            print(json.dumps({
                "round": r, "turn1_ttft_s": round(first.ttft_s, 3),
                "turn1_prompt_tokens": first.prompt_tokens,
                "turn1_again_ttft_s": round(again.ttft_s, 3),
                "turn1_again_cached_tokens": again.cached_tokens,
                "turn2_prompt_tokens": hit.prompt_tokens,
                "turn2_cached_ttft_s": round(hit.ttft_s, 3), "cached_tokens": hit.cached_tokens,
                "turn2_cold_ttft_s": round(cold.ttft_s, 3),
                "cold_cached_tokens": cold.cached_tokens, "load_average": load_average()}),
                flush=True)
        print(f"turn 1 (first):      {summary(first_s)}")
        print(f"turn 1 again:        {summary(again_s)}")
        print(f"turn 2 cached:       {summary(cached_s)}")
        print(f"turn 2 cold:         {summary(cold_s)}")
        ratio = statistics.median(again_s) / statistics.median(first_s)
        print(f"repeated prompt, second / first TTFT (p50): {ratio:.3f} "
              f"(max of the per-round ratios: "
              f"{max(a / f for a, f in zip(again_s, first_s, strict=True)):.3f})")
        ratio = statistics.median(cold_s) / statistics.median(cached_s)
        print(f"turn 2, cold / cached TTFT (p50): {ratio:.1f}x")
        print(f"load average after: {load_average()}")
    finally:
        stop_server(server)


if __name__ == "__main__":
    main()
