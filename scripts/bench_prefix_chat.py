"""TTFT of a chat's second turn with a long shared prefix: served from the prefix cache, and
cold (the same request with `"cache_prompt": false`), side by side in one run against a real
`fairtick serve` at its default flags.

    python scripts/bench_prefix_chat.py --prefix-tokens 4000 --rounds 5

Each round: turn 1 (a system prompt of `--prefix-tokens` characters, one token each on the
built-in model, and a question), then turn 2 (turn 1, its answer and a new question) twice:
cached, then cold. Prints every TTFT, their p50 / p95 / p99 / worst, and cold / cached.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib.serve import start_server, stop_server  # noqa: E402
from openai import OpenAI  # noqa: E402


def ttft(client: OpenAI, model: str, messages: list[dict[str, str]], max_tokens: int,
         cache: bool) -> tuple[float, str, int]:
    """Seconds to the first content token, the whole answer, and the cached prompt tokens."""
    start, first, text, cached = time.perf_counter(), None, "", -1
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"cache_prompt": cache})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text += chunk.choices[0].delta.content
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    assert first is not None, "no token came"
    return first - start, text, cached


def _summary(samples: list[float]) -> str:
    q = statistics.quantiles(samples, n=100, method="inclusive") if len(samples) > 1 \
        else samples * 99
    return (f"p50 {q[49]:.3f} s  p95 {q[94]:.3f} s  p99 {q[98]:.3f} s  "
            f"worst {max(samples):.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix-tokens", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    log = Path(tempfile.mkdtemp()) / "serve.log"
    server = start_server([], log)
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                        timeout=600)
        model = client.models.list().data[0].id
        cached_s, cold_s, rows = [], [], []
        for r in range(args.rounds):
            rng = random.Random(r)
            system = "".join(chr(rng.randrange(32, 127)) for _ in range(args.prefix_tokens))
            turn1 = [{"role": "system", "content": system},
                     {"role": "user", "content": "What comes first?"}]
            first_s, answer, _ = ttft(client, model, turn1, args.max_tokens, cache=True)
            turn2 = turn1 + [{"role": "assistant", "content": answer},
                             {"role": "user", "content": "And then?"}]
            hit_s, hit_text, hit_tokens = ttft(client, model, turn2, args.max_tokens, cache=True)
            cold, cold_text, cold_tokens = ttft(client, model, turn2, args.max_tokens, cache=False)
            assert hit_text == cold_text, "greedy output must not depend on the cache"
            cached_s.append(hit_s)
            cold_s.append(cold)
            rows.append({"round": r, "turn1_ttft_s": round(first_s, 3),
                         "turn2_cached_ttft_s": round(hit_s, 3), "cached_tokens": hit_tokens,
                         "turn2_cold_ttft_s": round(cold, 3), "cold_cached_tokens": cold_tokens})
            print(json.dumps(rows[-1]), flush=True)
        print(f"turn 2 cached: {_summary(cached_s)}")
        print(f"turn 2 cold:   {_summary(cold_s)}")
        ratio = statistics.median(cold_s) / statistics.median(cached_s)
        print(f"cold / cached TTFT (p50): {ratio:.1f}x")
    finally:
        stop_server(server)


if __name__ == "__main__":
    main()
