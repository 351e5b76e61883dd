"""Decode throughput with 0, 1 and all of S streams constrained by a grammar (in-process engine).

S streams (default 16) of the built-in model decode `--tokens` tokens each, greedy, in one
engine at its default flags; in each arm 0, 1 or all S of them carry a grammar: a JSON object
whose one string property must be longer than the run (`{"text": "...`), so a constrained
stream never ends early and every token is masked. Arms alternate over `--rounds` rounds.
Prints, per arm: generated tokens per second over the wall time from the first submission to
the last token, and the gaps between a stream's tokens pooled over the streams (p50/p95/p99/max,
ms); the ratio of each arm's tokens/s to the unconstrained arm of the same round; and what the
engine's tick cost model learned: a 16-row decode step predicted with 0, 1 and 16 rows masked.
Prompts skip the prefix cache (`cache_prompt` false), so every arm prefills the same.

    .venv/bin/python scripts/bench_grammar_decode.py [--streams 16] [--tokens 200] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from runtime.api import GenerationRequest, TokenEvent  # noqa: E402
from runtime.budget import TickShape  # noqa: E402
from runtime.engine import Engine, EngineConfig  # noqa: E402
from runtime.grammar import Grammar, ResponseFormat  # noqa: E402
from runtime.model import load_model  # noqa: E402
from runtime.sampling import SamplingParams  # noqa: E402

LONG_TEXT = {"type": "object", "properties": {"text": {"type": "string", "minLength": 100_000}},
             "required": ["text"], "additionalProperties": False}


class Timings:
    """Token arrival times per request; `done` is set when every request has finished."""

    def __init__(self, expected: int) -> None:
        self.times: dict[str, list[float]] = {}
        self.texts: dict[str, str] = {}
        self.finished = 0
        self.expected = expected
        self.done = threading.Event()
        self._lock = threading.Lock()

    def sink(self, event: TokenEvent) -> None:
        with self._lock:
            if event.token_id is not None:
                self.times.setdefault(event.request_id, []).append(time.perf_counter())
            self.texts[event.request_id] = self.texts.get(event.request_id, "") + event.text
            if event.finish_reason is not None:
                self.finished += 1
                if self.finished == self.expected:
                    self.done.set()


def run_arm(engine: Engine, grammar: Grammar, streams: int, constrained: int, tokens: int,
            tag: str) -> dict[str, Any]:
    timings = Timings(streams)
    start = time.perf_counter()
    for i in range(streams):
        rng = random.Random(i)
        prompt = tuple(rng.randrange(32, 127) for _ in range(32))
        engine.submit(GenerationRequest(f"{tag}-{i}", prompt, SamplingParams(max_tokens=tokens),
                                        cache_prompt=False,
                                        grammar=grammar if i < constrained else None),
                      timings.sink)
    if not timings.done.wait(600):
        raise RuntimeError("the arm did not finish in 600 s")
    masked = sum(text.startswith('{"text": "') for text in timings.texts.values())
    if masked != constrained:  # the free noise model never writes this by itself
        raise RuntimeError(f"{masked} streams wrote the grammar's document, not {constrained}")
    end = max(t[-1] for t in timings.times.values())
    total = sum(len(t) for t in timings.times.values())
    gaps = np.concatenate([np.diff(t) for t in timings.times.values()]) * 1e3
    return {"constrained": constrained, "tokens": total, "tok_s": total / (end - start),
            "gap_ms": {q: float(np.quantile(gaps, p)) for q, p in
                       (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))} | {"max": float(gaps.max())}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    engine = Engine(EngineConfig(), load_model(None))
    engine.start()
    results = []
    try:
        grammar = engine.grammars.compile(ResponseFormat("json_schema", LONG_TEXT))
        run_arm(engine, grammar, args.streams, 0, 20, "warm")
        arms = [0, 1, args.streams]
        for r in range(args.rounds):
            order = arms if r % 2 == 0 else arms[::-1]
            for constrained in order:
                row = run_arm(engine, grammar, args.streams, constrained, args.tokens,
                              f"r{r}-c{constrained}")
                results.append({"round": r, **row})
                print(json.dumps(results[-1]), flush=True)
    finally:
        engine.stop()
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    rows = (32 + args.tokens,) * args.streams
    costs = engine.budget.costs
    predicted = {c: costs.predict_s(TickShape(rows, (), c)) for c in (0, 1, args.streams)}
    print("cost model, a decode step of", args.streams, "rows at context", rows[0], "predicted:",
          ", ".join(f"{c} masked {1e3 * s:.2f} ms" for c, s in predicted.items() if s))
    for r in range(args.rounds):
        base = next(x["tok_s"] for x in results if x["round"] == r and x["constrained"] == 0)
        for x in results:
            if x["round"] == r:
                print(f"round {r}: {x['constrained']:2d} constrained: {x['tok_s']:7.1f} tok/s "
                      f"({x['tok_s'] / base:.2f}x unconstrained), gaps ms p50/p95/p99/max "
                      + "/".join(f"{x['gap_ms'][k]:.1f}" for k in ("p50", "p95", "p99", "max")))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
