"""Kernel-level timings of the MLX execution layer, without the scheduler or HTTP.

Prints (a) the Executor's batched decode step time per batch size, next to two mlx-lm
baselines for the same batch: a bare pipelined decode loop over mlx-lm's BatchKVCache (what the
engine is compared to elsewhere) and mlx-lm's own BatchGenerator; (b) the time of one prefill
chunk at context 0 and at a long context.

    .venv/bin/python scripts/bench_decode_kernel.py [--model DIR] [--batches 1,4,8,32]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import runtime  # noqa: E402, F401  (loads the optimized BLAS before MLX: runtime/blas.py)

# isort: split
import mlx.core as mx  # noqa: E402
from mlx_lm.generate import BatchGenerator  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache  # noqa: E402

from runtime.executor import Executor  # noqa: E402
from runtime.model import ModelBundle, load_model  # noqa: E402
from runtime.sampling import SamplingParams  # noqa: E402


def make_prompts(num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(32, 127) for _ in range(length)] for _ in range(num)]


def executor_decode_s(bundle: ModelBundle, prompts: list[list[int]], steps: int) -> float:
    """Median seconds of one Executor.decode over the whole batch."""
    ex = Executor(bundle)
    for i, prompt in enumerate(prompts):
        ex.add(i, prompt, SamplingParams(max_tokens=steps + 8))
        ex.prefill(i, len(prompt))
    ids = list(range(len(prompts)))
    for _ in range(4):  # warm-up; also merges the batch once
        ex.decode(ids)
    times = []
    for _ in range(steps):
        tic = time.perf_counter()
        ex.decode(ids)
        times.append(time.perf_counter() - tic)
    for i in ids:
        ex.release(i)
    return statistics.median(times)


def bare_mlx_lm_decode_s(bundle: ModelBundle, prompts: list[list[int]], steps: int) -> float:
    """Seconds per step of a bare greedy loop: BatchKVCache + argmax, async_eval pipelined."""
    model = bundle.model
    caches = []
    for prompt in prompts:
        cache = make_prompt_cache(model)
        model(mx.array(prompt[:-1])[None], cache=cache)  # prompts have > 1 token
        mx.eval([c.state for c in cache])
        caches.append(cache)
    batch = [BatchKVCache.merge(list(layer)) for layer in zip(*caches, strict=True)]
    y = mx.array([p[-1] for p in prompts])

    def step(tokens: mx.array) -> mx.array:
        return mx.argmax(model(tokens[:, None], cache=batch)[:, -1, :], axis=-1)

    for _ in range(4):
        y = step(y)
        mx.eval(y)
    tic = time.perf_counter()
    y = step(y)
    mx.async_eval(y)
    for _ in range(steps - 1):
        next_y = step(y)
        mx.async_eval(next_y)
        y.tolist()  # what a server would read each step
        y = next_y
    y.tolist()
    return (time.perf_counter() - tic) / steps


def batch_generator_decode_s(bundle: ModelBundle, prompts: list[list[int]], steps: int) -> float:
    """Seconds per generation step of mlx-lm's BatchGenerator once all prompts decode."""
    gen = BatchGenerator(
        bundle.model,
        max_tokens=steps + 64,
        completion_batch_size=len(prompts),
        prefill_batch_size=len(prompts),
    )
    gen.insert(prompts)
    while len(gen.next_generated()) < len(prompts):  # until every prompt decodes
        pass
    for _ in range(4):
        gen.next()
    tic = time.perf_counter()
    for _ in range(steps):
        gen.next()
    elapsed = time.perf_counter() - tic
    gen.close()
    return elapsed / steps


def prefill_chunk_s(bundle: ModelBundle, context: int, chunk: int) -> float:
    """Seconds of one `chunk`-token Executor.prefill call that starts at `context`."""
    ex = Executor(bundle)
    (prompt,) = make_prompts(1, context + chunk + 1, seed=7)
    ex.add(0, prompt, SamplingParams())
    ex.prefill(0, chunk)  # warm-up at context 0 (its result is not used)
    if context == 0:
        ex.release(0)
        ex.add(0, prompt, SamplingParams())
    while len(prompt) - ex.prompt_left(0) < context:
        ex.prefill(0, min(chunk, context - (len(prompt) - ex.prompt_left(0))))
    tic = time.perf_counter()
    ex.prefill(0, chunk)
    elapsed = time.perf_counter() - tic
    ex.release(0)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="mlx-lm model dir (default: built-in)")
    parser.add_argument("--batches", default="1,4,8,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--long-context", type=int, default=9216)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args()
    if args.prompt_len < 2:
        parser.error("--prompt-len must be at least 2")

    bundle = load_model(args.model)
    results: dict[str, object] = {"model": bundle.name, "prompt_len": args.prompt_len}
    rows = []
    for size in [int(b) for b in args.batches.split(",")]:
        prompts = make_prompts(size, args.prompt_len, seed=size)
        ours = executor_decode_s(bundle, prompts, args.steps)
        bare = bare_mlx_lm_decode_s(bundle, prompts, args.steps)
        batch_gen = batch_generator_decode_s(bundle, prompts, args.steps)
        rows.append(
            {
                "batch": size,
                "executor_step_ms": ours * 1e3,
                "executor_tok_s": size / ours,
                "bare_mlx_lm_step_ms": bare * 1e3,
                "bare_mlx_lm_tok_s": size / bare,
                "batch_generator_step_ms": batch_gen * 1e3,
                "batch_generator_tok_s": size / batch_gen,
            }
        )
    results["decode"] = rows
    prefill = {ctx: prefill_chunk_s(bundle, ctx, args.chunk) for ctx in (0, args.long_context)}
    results["prefill_chunk_ms"] = {str(k): v * 1e3 for k, v in prefill.items()}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"model {bundle.name}, prompts of {args.prompt_len} tokens, {args.steps} steps")
    print("(a) batched decode step, greedy")
    print(
        f"{'batch':>5} {'executor ms':>12} {'tok/s':>8} {'bare mlx-lm ms':>15} {'tok/s':>8} "
        f"{'BatchGenerator ms':>18} {'tok/s':>8}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['executor_step_ms']:>12.2f} {r['executor_tok_s']:>8.0f} "
            f"{r['bare_mlx_lm_step_ms']:>15.2f} {r['bare_mlx_lm_tok_s']:>8.0f} "
            f"{r['batch_generator_step_ms']:>18.2f} {r['batch_generator_tok_s']:>8.0f}"
        )
    print(f"(b) one {args.chunk}-token prefill chunk")
    for ctx, seconds in prefill.items():
        print(f"  at context {ctx:>6}: {seconds * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
