"""Decode steps of streams started from a cached prefix against streams prefilled cold, in one
process on the built-in model (the executor and the prefix cache, no server): the cache must
cost nothing once a sequence decodes.

    python scripts/bench_prefix_decode.py --prefix-tokens 2000 --streams 4 --rounds 6

Each round adds `--streams` sequences (a shared system prompt of `--prefix-tokens` tokens and
10 tokens of their own), either with the system prompt attached from a prefix-cache entry or
prefilled in full, then times `--steps` batched decode steps. Rounds alternate which arm goes
first. Prints each round's median step and every step's p50 / p95 / p99 / max per arm.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib.windows import percentile  # noqa: E402

from runtime.executor import Executor  # noqa: E402
from runtime.model import BOS_ID, load_model  # noqa: E402
from runtime.prefix_cache import PrefixCache  # noqa: E402
from runtime.sampling import SamplingParams  # noqa: E402


def run_round(executor: Executor, cache: PrefixCache | None, system: list[int], streams: int,
              steps: int, first_id: int, rng: random.Random) -> list[float]:
    """Seconds of each decode step of `streams` new sequences (attached from `cache` if given)."""
    ids = list(range(first_id, first_id + streams))
    for seq_id in ids:
        prompt = [BOS_ID, *system, *(rng.randrange(32, 127) for _ in range(10))]
        prefix = cache.lookup(prompt) if cache is not None else None
        executor.add(seq_id, prompt, SamplingParams(max_tokens=steps + 2), prefix=prefix)
        while executor.prompt_left(seq_id):
            executor.prefill(seq_id, 512)
    executor.decode(ids)  # the batch forms: one copy, not timed
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        executor.decode(ids)
        times.append(time.perf_counter() - start)
    for seq_id in ids:
        executor.release(seq_id)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    print(f"load average before: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")
    executor, rng = Executor(load_model(None)), random.Random(0)
    system = [rng.randrange(32, 127) for _ in range(args.prefix_tokens)]
    cache = PrefixCache(10 * args.prefix_tokens)
    executor.add(0, [BOS_ID, *system, 65], SamplingParams(max_tokens=2))
    while executor.prompt_left(0):
        executor.prefill(0, 512)
    cache.insert(*executor.kv_of(0))
    executor.release(0)
    steps: dict[str, list[float]] = {"attached": [], "cold": []}
    for r in range(args.rounds):
        order = ("attached", "cold") if r % 2 == 0 else ("cold", "attached")
        medians = {}
        for arm in order:
            times = run_round(executor, cache if arm == "attached" else None, system,
                              args.streams, args.steps, 1000 * (r + 1) + 100 * len(medians),
                              rng)
            steps[arm] += times
            medians[arm] = percentile(times, 50) * 1e3
        print(f"round {r}: median step attached {medians['attached']:.2f} ms, "
              f"cold {medians['cold']:.2f} ms")
    for arm, times in steps.items():
        q = [percentile(times, p) * 1e3 for p in (50, 95, 99)]
        print(f"{arm}: p50 {q[0]:.2f} ms  p95 {q[1]:.2f} ms  p99 {q[2]:.2f} ms  "
              f"max {max(times) * 1e3:.2f} ms  (n={len(times)})")
    print(f"load average after: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
