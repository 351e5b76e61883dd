"""Engine throughput against a bare mlx-lm decode loop, and the scheduler's share of a tick.

    .venv/bin/python scripts/bench_engine.py [--batches 4,8,32] [--tokens 96]

For each batch size B: B requests start together on an engine with --max-running B; the engine's
steady-state decode rate is the tokens produced while all B decode, per second. The same run
measures a bare batched greedy decode loop over mlx-lm's BatchKVCache on the same model and
batch. The ratio engine/bare is printed (goal >= 0.9). Then, at 8 and 64 sequences, the time
the engine spent in the scheduler core (decide_tick, triggers, bookkeeping: the
fairtick_scheduler_seconds counter) as a share of all tick time (goal <= 2%).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_decode_kernel import bare_mlx_lm_decode_s, make_prompts  # noqa: E402

from runtime.engine import Engine, EngineConfig  # noqa: E402
from runtime.model import ModelBundle, load_model  # noqa: E402
from tests.runtime.engine_harness import Collector, submit  # noqa: E402


def engine_run(bundle: ModelBundle, batch: int, tokens: int, policy: str) -> tuple[float, float]:
    """(decode tokens/s while all `batch` decode, scheduler share of tick time)."""
    engine = Engine(EngineConfig(max_running=batch, prefill_chunk_size=512, policy=policy), bundle)
    engine.start()
    got = Collector()
    ids = [f"r{i}" for i in range(batch)]
    try:
        for rid, prompt in zip(ids, make_prompts(batch, 128, seed=batch), strict=True):
            submit(engine, got, rid, prompt, max_tokens=tokens)
        got.wait(*ids, timeout=600)
    finally:
        engine.stop()
    all_started = max(got.first_token_time(r) for r in ids)
    first_done = min(got.events[r][-1][0] for r in ids)
    produced = sum(sum(1 for t, e in got.events[r] if all_started < t <= first_done
                       and e.token_id is not None) for r in ids)
    sched_s = engine.metrics.scheduler_time._value.get()
    tick_s = engine.metrics.tick_duration._sum.get()
    return produced / (first_done - all_started), sched_s / tick_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="4,8,32")
    parser.add_argument("--tokens", type=int, default=96, help="tokens per request")
    parser.add_argument("--policy", default="default")
    args = parser.parse_args()
    bundle = load_model(None)
    print(f"model {bundle.name}; policy {args.policy}; {args.tokens} tokens per request")
    print(f"{'batch':>5} {'engine tok/s':>13} {'bare mlx-lm tok/s':>18} {'ratio':>6}")
    for batch in [int(b) for b in args.batches.split(",")]:
        rate, _ = engine_run(bundle, batch, args.tokens, args.policy)
        bare = batch / bare_mlx_lm_decode_s(bundle, make_prompts(batch, 128, seed=batch),
                                            args.tokens)
        print(f"{batch:>5} {rate:>13.0f} {bare:>18.0f} {rate / bare:>6.2f}")
        time.sleep(0.5)
    print(f"\n{'sequences':>9} {'scheduler share of tick time':>29}")
    for batch in (8, 64):
        _, share = engine_run(bundle, batch, args.tokens, args.policy)
        print(f"{batch:>9} {share:>29.2%}")


if __name__ == "__main__":
    main()
