"""The tick cost model against measured ticks: its prediction error and how far ticks overshoot.

For each stream count S: an in-process engine (policy token_budget, whose slices the cost model
sizes to `itl_factor` x the streams' decode-step p95 as the engine measures it, grown by its
probes of their step while the prompt is parked: runtime/budget.py) runs S decoding streams;
after a quiet window one long prompt arrives and prefills in budgeted slices next to them; the
streams are aborted once it has its first token. Every tick's prediction is the one the model
made before the tick ran (runtime/budget.py records it), so the error is what the engine met
online. The ticks that probe the streams' step (decode rows and slice in two forwards) are not
the model's and are not in its records.

Prints, per S: the relative prediction error |predicted / measured - 1| (p50/p95/p99/max) over
decode-only ticks, over ticks with a slice, and over every tick after the model's first 100;
the measured / target ratio of budgeted ticks (p50/p95/p99/max) and how many overshot the
target (and by more than 25%); the slices' sizes, the prompt's TTFT, and the streams'
inter-token gaps while it prefilled.

    .venv/bin/python scripts/bench_tick_cost.py [--streams 4,16] [--prompt-tokens 2000]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from runtime.budget import TickRecord  # noqa: E402
from runtime.engine import Engine, EngineConfig  # noqa: E402
from runtime.model import ModelBundle, load_model  # noqa: E402
from tests.runtime.engine_harness import Collector, submit, wait_until  # noqa: E402

WARM_TICKS = 100  # the error is also reported without the model's first ticks


class TimedCollector(Collector):
    """The harness's Collector, with the time each event arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.times: dict[str, list[tuple[float, Any]]] = defaultdict(list)

    def sink(self, event: Any) -> None:
        self.times[event.request_id].append((time.monotonic(), event))
        super().sink(event)

    def first_token_time(self, request_id: str) -> float:
        return next(t for t, e in self.times[request_id] if e.token_id is not None)


def quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    arr = np.array(values)
    return {"n": len(values), "p50": float(np.quantile(arr, 0.5)),
            "p95": float(np.quantile(arr, 0.95)), "p99": float(np.quantile(arr, 0.99)),
            "max": float(arr.max())}


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(length)]


def run(bundle: ModelBundle, streams: int, prompt_tokens: int, quiet_ticks: int,
        policy: str) -> dict[str, Any]:
    engine = Engine(EngineConfig(max_running=streams + 1, policy=policy, max_waiting=streams + 1),
                    bundle)
    engine.start()
    got, ids = TimedCollector(), [f"s{i}" for i in range(streams)]
    try:
        for i, rid in enumerate(ids):
            submit(engine, got, rid, prompt(16, i), max_tokens=bundle.context_length // 2)
        wait_until(lambda: all(len(got.tokens(r)) >= quiet_ticks for r in ids), timeout=600)
        arrival = time.monotonic()
        submit(engine, got, "long", prompt(prompt_tokens, 99), max_tokens=2)
        wait_until(lambda: got.tokens("long"), timeout=3600)
        for rid in ids:
            engine.abort(rid)
        got.wait("long", *ids, timeout=60)
    finally:
        engine.stop()
    ttft = got.first_token_time("long") - arrival
    return summarize(list(engine.budget.costs.records), got, ids, arrival, ttft)


def summarize(records: list[TickRecord], got: TimedCollector, ids: list[str], arrival: float,
              ttft: float) -> dict[str, Any]:
    def error(r: TickRecord) -> float:
        assert r.predicted_s is not None
        return abs(r.predicted_s / r.measured_s - 1)

    predicted = [r for r in records if r.predicted_s is not None]
    budgeted = [r for r in records if r.target_s is not None]
    ratios = [r.measured_s / r.target_s for r in budgeted if r.target_s]
    end = got.first_token_time("long")
    gaps = []
    for rid in ids:
        times = [t for t, e in got.times[rid] if e.token_id is not None and arrival <= t <= end]
        gaps += list(np.diff(times))
    return {
        "ticks": len(records),
        "error_decode_only": quantiles([error(r) for r in predicted if not r.shape.slices]),
        "error_with_slice": quantiles([error(r) for r in predicted if r.shape.slices]),
        "error_warm": quantiles([error(r) for r in predicted[WARM_TICKS:]]),
        "over_target": quantiles(ratios),
        "num_budgeted": len(budgeted),
        "num_over_target": sum(x > 1.0 for x in ratios),
        "num_over_125": sum(x > 1.25 for x in ratios),
        "slice_tokens": quantiles([float(r.shape.slices[0].num_tokens) for r in budgeted
                                   if r.shape.slices]),
        "ttft_s": ttft,
        "stream_gap_ms": quantiles([g * 1e3 for g in gaps]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="mlx-lm model dir (default: built-in)")
    parser.add_argument("--streams", default="4,16")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--quiet-ticks", type=int, default=40,
                        help="tokens each stream decodes before the prompt arrives")
    parser.add_argument("--policy", default="token_budget",
                        help="a policy with tick_budget_ms (its slices are sized)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args()
    bundle = load_model(args.model)
    results = {}
    for streams in [int(s) for s in args.streams.split(",")]:
        results[streams] = run(bundle, streams, args.prompt_tokens, args.quiet_ticks,
                               args.policy)
        if not args.json:
            print(format_run(streams, results[streams]), flush=True)
    if args.json:
        print(json.dumps({"model": bundle.name, "policy": args.policy,
                          "prompt_tokens": args.prompt_tokens, "runs": results}, indent=2))


def format_run(streams: int, r: dict[str, Any]) -> str:
    def q(d: dict[str, float], scale: float = 1.0, unit: str = "") -> str:
        if not d:
            return "-"
        return " ".join(f"{k} {d[k] * scale:.2f}{unit}" for k in ("p50", "p95", "p99", "max"))

    return "\n".join([
        f"{streams} streams, {r['ticks']} ticks; prompt TTFT {r['ttft_s']:.2f} s",
        f"  |predicted/measured - 1|  decode-only ({r['error_decode_only'].get('n', 0)}): "
        f"{q(r['error_decode_only'], 100, '%')}",
        f"  |predicted/measured - 1|  with a slice ({r['error_with_slice'].get('n', 0)}): "
        f"{q(r['error_with_slice'], 100, '%')}",
        f"  |predicted/measured - 1|  every tick after the first {WARM_TICKS} "
        f"({r['error_warm'].get('n', 0)}): {q(r['error_warm'], 100, '%')}",
        f"  measured/target, budgeted ticks ({r['num_budgeted']}): {q(r['over_target'])}; "
        f"over target {r['num_over_target']}, over 1.25x {r['num_over_125']}",
        f"  slice tokens: {q(r['slice_tokens'])}",
        f"  streams' gaps while the prompt prefilled: {q(r['stream_gap_ms'], 1, ' ms')}",
    ])


if __name__ == "__main__":
    main()
