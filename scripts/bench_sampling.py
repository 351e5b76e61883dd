"""The per-step cost of the sampling controls: decode steps of S streams, all greedy vs all
sampled with every control (temperature, top_p, top_k, min_p, presence/frequency/repetition
penalties, a logit bias) vs greedy with logprobs, on the Executor in-process.

Each mode prefills S prompts and runs warm-up steps; then the modes take turns, 10 decode steps
of all S streams each, until each has run `--steps` (the executor's pipelined loop, as the
engine runs it when nothing else is queued).
Prints per mode: decode tokens/s, the step time (p50/p95/p99/max) and the ratio of tokens/s to
greedy, measured in this run. `--vocab N` uses a random Llama with an N-token vocabulary
(the built-in model has 258) to show how the controls' cost grows with the vocabulary.

    .venv/bin/python scripts/bench_sampling.py [--streams 16] [--steps 200] [--vocab 32000]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import mlx.core as mx  # noqa: E402
from mlx_lm.models import llama  # noqa: E402

from runtime.executor import Executor  # noqa: E402
from runtime.model import BUILTIN_CONFIG, ModelBundle, load_model  # noqa: E402
from runtime.sampling import SamplingParams  # noqa: E402

WARM_STEPS = 20
BLOCK_STEPS = 10
PROMPT_TOKENS = 64


def modes(max_tokens: int) -> dict[str, SamplingParams]:
    greedy = SamplingParams(max_tokens=max_tokens)
    controls = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.05,
                              presence_penalty=0.5, frequency_penalty=0.5,
                              repetition_penalty=1.1, logit_bias=((65, 2.0), (66, -2.0)),
                              max_tokens=max_tokens)
    return {"greedy": greedy, "sampled+controls": controls,
            "greedy+logprobs(5)": SamplingParams(max_tokens=max_tokens, logprobs=5)}


def bundle_for(vocab: int | None) -> ModelBundle:
    if vocab is None:
        return load_model(None)
    mx.random.seed(0)
    args = {**BUILTIN_CONFIG, "vocab_size": vocab}
    model = llama.Model(llama.ModelArgs.from_dict(args))
    mx.eval(model.parameters())
    return ModelBundle(model, None, Path("."), f"random-llama-{vocab}", 4096, frozenset(), None)


def prefilled(bundle: ModelBundle, params: SamplingParams, streams: int) -> Executor:
    ex = Executor(bundle)
    rng = random.Random(1)
    for seq_id in range(streams):
        prompt = [rng.randrange(32, 127) for _ in range(PROMPT_TOKENS)]
        seeded = params if params.is_greedy else replace(params, seed=seq_id)
        ex.add(seq_id, prompt, seeded)
        ex.prefill(seq_id, PROMPT_TOKENS)
    return ex


def timed_steps(ex: Executor, streams: int, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        ex.decode(list(range(streams)))
        ex.take_logprobs()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--vocab", type=int, default=None)
    args = parser.parse_args()
    bundle = bundle_for(args.vocab)
    print(f"# {bundle.name} (vocab {bundle.vocab_size}), {args.streams} streams, "
          f"{args.steps} decode steps each, modes interleaved in blocks of {BLOCK_STEPS}")
    executors = {name: prefilled(bundle, params, args.streams)
                 for name, params in modes(WARM_STEPS + args.steps + 2).items()}
    times: dict[str, list[float]] = {name: [] for name in executors}
    for ex in executors.values():
        timed_steps(ex, args.streams, WARM_STEPS)
    for _ in range(0, args.steps, BLOCK_STEPS):  # interleaved: a busy machine hits every mode
        for name, ex in executors.items():
            times[name] += timed_steps(ex, args.streams, BLOCK_STEPS)
    greedy_rate = None
    for name, measured in times.items():
        arr = np.array(measured)
        rate = args.streams * len(arr) / arr.sum()
        greedy_rate = greedy_rate or rate
        ms = {q: float(np.quantile(arr, p)) * 1e3 for q, p in
              (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))}
        print(f"{name:20s} {rate:9.0f} tok/s  step ms p50 {ms['p50']:.2f} p95 {ms['p95']:.2f} "
              f"p99 {ms['p99']:.2f} max {arr.max() * 1e3:.2f}  "
              f"vs greedy {rate / greedy_rate:.2f}x")


if __name__ == "__main__":
    main()
