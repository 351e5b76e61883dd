"""A mixed tick's time: one fused forward against two forwards (and a padded batch), per shape.

A mixed tick runs one decode step for R streams and one prefill slice of t prompt tokens. Three
ways to run it, timed on the same caches (the tick's tokens are trimmed off after each run):

  fused   one forward over the ragged batch (runtime/fused.py): projections and MLP over all
          R + t tokens, attention per segment against its own cache;
  apart   what a mixed tick was before: the slice's own forward, evaluated, then the batch's;
  padded  one mlx-lm forward over a (R + 1, t) batch in one BatchKVCache, every row padded to
          the slice's length (measured only where (R + 1) * t <= --padded-max-tokens).

With --activation-ab it times the fused forward of each shape (no decode rows where --rows is
0, no slice where --slices is 0) with the MLP's activation through fairtick's native kernel
and through MLX's ops (runtime/fused.py `_mlp`), alternated.

With --decode-against DIR it times decode-only ticks (pipelined) of this Executor against the
Executor of another checkout DIR, loaded in the same process, blocks of 20 steps alternated.

With --executor it times whole ticks of the Executor instead (sampling and bookkeeping
included): `Executor.run` with R decode rows and a t-token slice of each of --executor-prompts
prompts (default 1), on two executors holding the same sequences, one fused and one running
the forwards apart, alternated; the streams and the prompts start at --executor-context tokens.

The streams and the prompt share a context c (the streams have at least a 16-token prompt; the
caches are filled once per c). Each shape runs
--reps times per way, the ways alternated; it prints the median and the worst ms, and the
median of the per-repetition ratios fused/apart and padded/fused.

    .venv/bin/python scripts/bench_fused_tick.py [--rows 4,16] [--slices 16,64,256]
        [--contexts 0,4000,8000] [--reps 5] [--json]
    .venv/bin/python scripts/bench_fused_tick.py --executor [--rows 4,16] [--slices 1,16,64]
    .venv/bin/python scripts/bench_fused_tick.py --decode-against OTHER_CHECKOUT [--reps 16]
    .venv/bin/python scripts/bench_fused_tick.py --activation-ab --rows 0,4 --slices 0,64,512
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import runtime  # noqa: E402, F401  (first: a BLAS that runtime loads must precede MLX)

# isort: split
import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache  # noqa: E402

from runtime import native  # noqa: E402
from runtime.executor import Executor, Slice  # noqa: E402
from runtime.fused import Segment, forward_fused  # noqa: E402
from runtime.model import load_model  # noqa: E402
from runtime.sampling import SamplingParams  # noqa: E402


def tokens(num: int, rng: random.Random) -> mx.array:
    return mx.array([rng.randrange(32, 127) for _ in range(num)])


def filled(model: Any, context: int, rng: random.Random) -> list[Any]:
    """A prompt cache holding `context` tokens (at least 16: a stream has a prompt)."""
    cache = make_prompt_cache(model)
    done, context = 0, max(context, 16)
    while done < context:
        n = min(512, context - done)
        model(tokens(n, rng)[None], cache=cache)
        mx.eval([c.state for c in cache])
        done += n
    return cache


def copy_of(model: Any, cache: list[Any], context: int) -> list[Any]:
    """The prompt's own KVCache: the first `context` tokens of `cache`."""
    out = make_prompt_cache(model)
    if context:
        for dst, src in zip(out, cache, strict=True):
            dst.state = (src.keys[..., :context, :], src.values[..., :context, :], context)
    return out


def batch_of(cache: list[Any], rows: int) -> list[BatchKVCache]:
    batch = [BatchKVCache.merge([layer] * rows) for layer in cache]
    mx.eval([c.state for c in batch])
    return batch


def timed(run: Callable[[], None], caches: list[tuple[list[Any], int]]) -> float:
    tic = time.perf_counter()
    run()
    elapsed = time.perf_counter() - tic
    for cache, num in caches:  # back to the shape's context for the next run
        for c in cache:
            c.trim(num)
    return elapsed


def measure(model: Any, rows: int, slice_tokens: int, batch: list[Any], prompt: list[Any],
            padded: list[Any] | None, reps: int, rng: random.Random) -> dict[str, Any]:
    step, chunk = tokens(rows, rng)[:, None], tokens(slice_tokens, rng)[None]

    def fused() -> None:
        segments = [Segment(step, batch, True), Segment(chunk, prompt, False)]
        mx.eval(forward_fused(model, segments), [c.state for c in prompt])

    def apart() -> None:
        model(chunk, cache=prompt)
        mx.eval([c.state for c in prompt])
        mx.eval(model(step, cache=batch)[:, -1, :])

    def pad() -> None:
        assert padded is not None
        mx.eval(model(mx.concatenate([mx.repeat(step, slice_tokens, axis=1), chunk]),
                      cache=padded)[:, -1, :])

    ways = {"fused": (fused, [(batch, 1), (prompt, slice_tokens)]),
            "apart": (apart, [(batch, 1), (prompt, slice_tokens)])}
    if padded is not None:
        ways["padded"] = (pad, [(padded, slice_tokens)])
    for run, caches in ways.values():  # warm-up
        timed(run, caches)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for rep in range(reps):
        order = list(ways) if rep % 2 == 0 else list(reversed(ways))
        for name in order:
            times[name].append(timed(*ways[name]))
    out: dict[str, Any] = {name: {"median_ms": statistics.median(t) * 1e3,
                                  "max_ms": max(t) * 1e3} for name, t in times.items()}
    out["fused_over_apart"] = statistics.median(
        f / a for f, a in zip(times["fused"], times["apart"], strict=True))
    if padded is not None:
        out["padded_over_fused"] = statistics.median(
            p / f for p, f in zip(times["padded"], times["fused"], strict=True))
    return out


def activation_ab(model: Any, rows: int, slice_tokens: int, batch: list[Any] | None,
                  prompt: list[Any], reps: int, rng: random.Random) -> dict[str, Any]:
    """Median ms of the fused forward of R rows and a t-token slice with the MLP's activation
    through the native kernel and through MLX's ops, alternated."""
    kernel = native.swiglu
    segments = ([Segment(tokens(rows, rng)[:, None], batch, True)] if rows else []) + \
        ([Segment(tokens(slice_tokens, rng)[None], prompt, True)] if slice_tokens else [])
    caches = [(s.cache, s.tokens.shape[1]) for s in segments]

    def run() -> None:
        mx.eval(forward_fused(model, segments), [c.state for s in segments for c in s.cache])

    ways = {"kernel": kernel, "ops": lambda: None}
    times: dict[str, list[float]] = {name: [] for name in ways}
    try:
        for rep in range(reps + 1):  # the first is a warm-up
            for name in (list(ways) if rep % 2 == 0 else list(reversed(ways))):
                native.swiglu = ways[name]
                elapsed = timed(run, caches)
                if rep:
                    times[name].append(elapsed)
    finally:
        native.swiglu = kernel
    return {"rows": rows, "slice": slice_tokens,
            **{name: statistics.median(t) * 1e3 for name, t in times.items()},
            "kernel_over_ops": statistics.median(
                k / o for k, o in zip(times["kernel"], times["ops"], strict=True))}


def executor_ticks(bundle: Any, rows: int, slice_tokens: int, context: int, reps: int,
                   prompts: int = 1) -> dict[str, Any]:
    """Median ms of `Executor.run(a slice of each of `prompts` prompts, R rows)`, fused and
    apart, alternated."""
    rng = random.Random(rows * 1000 + slice_tokens)
    streams = [[rng.randrange(32, 127) for _ in range(context)] for _ in range(rows)]
    longs = [[rng.randrange(32, 127) for _ in range(context + slice_tokens * (reps + 2) + 1)]
             for _ in range(prompts)]
    runs: dict[str, Executor] = {}
    for name, fuse in (("fused", True), ("apart", False)):
        ex = runs[name] = Executor(bundle, fuse=fuse)
        for i, prompt in enumerate([*streams, *longs]):
            ex.add(i, prompt, SamplingParams(max_tokens=reps + 8))
            ex.prefill(i, context if i >= rows else len(prompt))
    decode = list(range(rows))
    work = [Slice(rows + p, slice_tokens) for p in range(prompts)]
    times: dict[str, list[float]] = {name: [] for name in runs}
    for rep in range(reps + 1):  # the first is a warm-up
        for name in (list(runs) if rep % 2 == 0 else list(reversed(runs))):
            tic = time.perf_counter()
            runs[name].run(work, decode)
            if rep:
                times[name].append(time.perf_counter() - tic)
    return {"rows": rows, "slice": slice_tokens, "context": context, "prompts": prompts,
            **{name: {"median_ms": statistics.median(t) * 1e3, "max_ms": max(t) * 1e3}
               for name, t in times.items()},
            "fused_over_apart": statistics.median(
                f / a for f, a in zip(times["fused"], times["apart"], strict=True))}


def decode_against(bundle: Any, other_root: str, rows: int, reps: int) -> dict[str, Any]:
    """ms per pipelined decode step of this Executor and of `other_root`'s (another checkout,
    its runtime/executor.py loaded beside this one; the modules it imports are this
    checkout's), blocks of 20 steps alternated."""
    spec = importlib.util.spec_from_file_location(
        "other_executor", Path(other_root) / "runtime" / "executor.py")
    assert spec is not None and spec.loader is not None
    other = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = other  # its dataclasses look their module up there
    spec.loader.exec_module(other)
    rng = random.Random(rows)
    prompts = [[rng.randrange(32, 127) for _ in range(128)] for _ in range(rows)]
    runs = {"this": Executor(bundle), "other": other.Executor(bundle)}
    ids = list(range(rows))
    for ex in runs.values():
        for i, prompt in enumerate(prompts):
            ex.add(i, prompt, SamplingParams(max_tokens=20 * (reps + 2) + 8))
            ex.prefill(i, len(prompt))
        ex.decode(ids)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for rep in range(reps):
        for name in (list(runs) if rep % 2 == 0 else list(reversed(runs))):
            tic = time.perf_counter()
            for _ in range(20):
                runs[name].decode(ids)
            times[name].append((time.perf_counter() - tic) / 20)
    return {"rows": rows, **{name: statistics.median(t) * 1e3 for name, t in times.items()},
            "this_over_other": statistics.median(
                a / b for a, b in zip(times["this"], times["other"], strict=True))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="mlx-lm model dir (default: built-in)")
    parser.add_argument("--rows", default="4,16")
    parser.add_argument("--slices", default="16,64,256")
    parser.add_argument("--contexts", default="0,4000,8000")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--padded-max-tokens", type=int, default=1100)
    parser.add_argument("--executor", action="store_true", help="time Executor ticks")
    parser.add_argument("--executor-context", type=int, default=500)
    parser.add_argument("--executor-prompts", type=int, default=1,
                        help="prompts whose slices each executor tick runs")
    parser.add_argument("--decode-against", metavar="DIR",
                        help="time decode steps against the Executor of another checkout")
    parser.add_argument("--activation-ab", action="store_true",
                        help="time the MLP's activation kernel against MLX's ops")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args()
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    bundle = load_model(args.model)
    if args.activation_ab:
        if native.swiglu() is None:
            parser.error(f"no native kernels here: {native.reason()}")
        for context in [int(c) for c in args.contexts.split(",")]:
            base = filled(bundle.model, context, random.Random(context))
            for rows in [int(r) for r in args.rows.split(",")]:
                for slice_tokens in [int(t) for t in args.slices.split(",")]:
                    if not rows and not slice_tokens:
                        continue
                    r = activation_ab(bundle.model, rows, slice_tokens,
                                      batch_of(base, rows) if rows else None,
                                      copy_of(bundle.model, base, context), args.reps,
                                      random.Random(rows + slice_tokens))
                    print(f"context {context:>6} rows {rows:>3} slice {slice_tokens:>4}:  "
                          f"kernel {r['kernel']:7.2f} ms  ops {r['ops']:7.2f} ms  "
                          f"kernel/ops {r['kernel_over_ops']:5.2f}", flush=True)
        return
    if args.decode_against:
        for rows in [int(r) for r in args.rows.split(",")]:
            r = decode_against(bundle, args.decode_against, rows, args.reps)
            print(f"rows {rows:>3}: this {r['this']:.2f} ms/step, {args.decode_against} "
                  f"{r['other']:.2f} ms/step, this/other {r['this_over_other']:.3f}", flush=True)
        return
    if args.executor:
        ticks = []
        for rows in [int(r) for r in args.rows.split(",")]:
            for slice_tokens in [int(t) for t in args.slices.split(",")]:
                ticks.append(executor_ticks(bundle, rows, slice_tokens, args.executor_context,
                                            args.reps, args.executor_prompts))
                if not args.json:
                    print(format_row(ticks[-1]), flush=True)
        if args.json:
            print(json.dumps({"model": bundle.name, "reps": args.reps, "ticks": ticks}))
        return
    model, rng = bundle.model, random.Random(0)
    results = []
    for context in [int(c) for c in args.contexts.split(",")]:
        base = filled(model, context, rng)
        for rows in [int(r) for r in args.rows.split(",")]:
            batch = batch_of(base, rows)
            for slice_tokens in [int(t) for t in args.slices.split(",")]:
                prompt = copy_of(model, base, context)
                padded = batch_of(base, rows + 1) \
                    if (rows + 1) * slice_tokens <= args.padded_max_tokens else None
                row = {"rows": rows, "slice": slice_tokens, "context": context,
                       **measure(model, rows, slice_tokens, batch, prompt, padded, args.reps,
                                 rng)}
                results.append(row)
                if not args.json:
                    print(format_row(row), flush=True)
                del prompt, padded
            del batch
        del base
    if args.json:
        print(json.dumps({"model": bundle.name, "reps": args.reps, "ticks": results}, indent=2))


def format_row(row: dict[str, Any]) -> str:
    prompts = f" x{row['prompts']}" if row.get("prompts", 1) > 1 else ""
    text = (f"rows {row['rows']:>3} slice {row['slice']:>4}{prompts} context "
            f"{row['context']:>6}:  "
            f"fused {row['fused']['median_ms']:8.1f} ms (max {row['fused']['max_ms']:8.1f})  "
            f"apart {row['apart']['median_ms']:8.1f} ms (max {row['apart']['max_ms']:8.1f})  "
            f"fused/apart {row['fused_over_apart']:5.2f}")
    if "padded" in row:
        text += (f"  padded {row['padded']['median_ms']:8.1f} ms  "
                 f"padded/fused {row['padded_over_fused']:5.2f}")
    return text


if __name__ == "__main__":
    main()
