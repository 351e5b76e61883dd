"""A long prompt prefilled beside decoding streams, two ways, in-process on the real model.

  mixed:S      what the server's mixed ticks do: each tick is one `Executor.run` with the
               decode rows and an S-token slice of the prompt (one fused forward), the streams
               stepping once a tick;
  lane:C:P     a prefill lane: a second thread runs the prompt's prefill-only ticks of C tokens
               (on the same `Executor`, its forwards `layer_by_layer`: runtime/fused.py) while
               this thread steps the decode rows on their own, at most once every P times
               their quiet step's median;
  queued:C:P   the lane with its forwards' layers queued as the engine's are (MLX's task cap is
               shared by all threads: runtime/fused.py).

Before each arm: fresh decode rows (--rows sequences at --row-context tokens) step alone
(--quiet-steps; their p95 is the "own p95" every gap is divided by) and the same prompt is
prefilled alone in 512-token chunks, as a server does with no stream (its time is "alone").
Then the arm runs a fresh copy of the prompt to its end, timing every decode step's gap (from
one step's end to the next, what a client sees) and the prompt's time. The arms run in a
rotated order each round (A B, B A, ...); it prints each run and the medians [min, max] over
the rounds: TTFT / alone, the gaps' p50 / p95 / p99 / max over own p95, and the cores the
process kept busy (its CPU seconds, all threads, over the wall's) while the arm ran and while the
prompt ran alone.

    .venv/bin/python scripts/bench_prefill_lane.py [--arms mixed:32,mixed:64,lane:256:3]
        [--rounds 3] [--rows 4] [--row-context 1500] [--prompt-tokens 10000] [--lane-nice N]
        [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import runtime  # noqa: E402, F401  (first: a BLAS that runtime loads must precede MLX)

# isort: split
import mlx.core as mx  # noqa: E402

from runtime import kernels  # noqa: E402
from runtime.executor import Executor, Slice  # noqa: E402
from runtime.fused import layer_by_layer  # noqa: E402
from runtime.model import load_model  # noqa: E402
from runtime.sampling import SamplingParams  # noqa: E402

ALONE_CHUNK = 512  # the server's chunk with no stream to protect


@dataclass(frozen=True)
class Arm:
    kind: str  # mixed, lane, queued
    size: int  # mixed: slice tokens; lane, queued: chunk tokens
    pace: float = 0.0  # lane, queued: the decode rows' least period, in quiet step medians

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.size}" + (f":{self.pace:g}" if self.kind != "mixed" else "")


def parse_arm(text: str) -> Arm:
    """'mixed:S', 'lane:C:P' or 'queued:C:P'; ValueError naming what is allowed."""
    kind, *rest = text.split(":")
    try:
        if kind == "mixed" and len(rest) == 1 and int(rest[0]) >= 1:
            return Arm(kind, int(rest[0]))
        if kind in ("lane", "queued") and len(rest) == 2 and int(rest[0]) >= 1 \
                and float(rest[1]) >= 0:
            return Arm(kind, int(rest[0]), float(rest[1]))
    except ValueError:
        pass
    raise ValueError(f"arm {text!r}: expected mixed:S, lane:C:P or queued:C:P (S, C >= 1 "
                     "tokens, P >= 0)")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Lane:
    """A thread that runs the jobs handed to it (a prompt's prefill-only ticks)."""

    def __init__(self, nice: int = 0) -> None:
        self.nice = nice
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="prefill-lane", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self.nice:  # before MLX makes this thread's streams: their threads inherit it
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        kernels.warm_up()  # MLX keeps compiled functions per thread
        while (job := self._jobs.get()) is not None:
            job()
        mx.clear_streams()  # a thread's streams are freed by that thread

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        bundle = load_model(None)
        self.rng = random.Random(args.seed)
        self.decoder = Executor(bundle)
        self.lane = Lane(args.lane_nice)
        self._next_id = 0
        self.rows: list[int] = []
        self.new_rows()

    def new_rows(self) -> None:
        """Fresh decode rows at --row-context (so every arm starts the streams alike)."""
        for seq_id in self.rows:
            self.decoder.release(seq_id)
        self.rows = [self._new_id() for _ in range(self.args.rows)]
        for seq_id in self.rows:
            self.decoder.add(seq_id, self._tokens(self.args.row_context),
                             SamplingParams(max_tokens=self.args.row_max_tokens))
            self.decoder.prefill(seq_id, self.args.row_context)
        for _ in range(3):
            self.decoder.decode(self.rows)  # warm

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(32, 127) for _ in range(n)]

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def quiet(self) -> list[float]:
        gaps, last = [], time.perf_counter()
        for _ in range(self.args.quiet_steps):
            self.decoder.decode(self.rows)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        return gaps[5:]

    def prefill(self, executor: Executor, prompt: list[int], chunk: int) -> float:
        seq_id = self._new_id()
        executor.add(seq_id, prompt, SamplingParams(max_tokens=2))
        start = time.perf_counter()
        while (left := executor.prompt_left(seq_id)) > 0:
            executor.prefill(seq_id, min(chunk, left))
        took = time.perf_counter() - start
        executor.release(seq_id)
        return took

    def mixed(self, prompt: list[int], slice_tokens: int) -> tuple[float, list[float]]:
        seq_id = self._new_id()
        self.decoder.add(seq_id, prompt, SamplingParams(max_tokens=2))
        gaps, start = [], time.perf_counter()
        last = start
        while (left := self.decoder.prompt_left(seq_id)) > 0:
            self.decoder.run([Slice(seq_id, min(slice_tokens, left))], self.rows)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        took = time.perf_counter() - start
        self.decoder.release(seq_id)
        return took, gaps

    def laned(self, prompt: list[int], arm: Arm, step_s: float) -> tuple[float, list[float]]:
        # The prompt is added and released on this thread, as the engine's thread would; the
        # lane runs its prefill-only ticks on the same Executor (runtime/executor.py).
        done, took = threading.Event(), [0.0]
        seq_id = self._new_id()
        self.decoder.add(seq_id, prompt, SamplingParams(max_tokens=2))

        def prefill_all() -> None:
            start = time.perf_counter()
            while (left := self.decoder.prompt_left(seq_id)) > 0:
                self.decoder.run([Slice(seq_id, min(arm.size, left))], [])
            took[0] = time.perf_counter() - start

        def job() -> None:
            try:
                if arm.kind == "lane":
                    with layer_by_layer():
                        prefill_all()
                else:
                    prefill_all()
            finally:
                done.set()

        period = arm.pace * step_s
        self.lane.submit(job)
        gaps, last = [], time.perf_counter()
        while not done.is_set():
            self.decoder.decode(self.rows)
            now = time.perf_counter()
            if now - last < period:
                time.sleep(period - (now - last))
                now = time.perf_counter()
            gaps.append(now - last)
            last = now
        self.decoder.release(seq_id)
        return took[0], gaps

    def run_arm(self, arm: Arm) -> dict[str, float]:
        self.new_rows()
        quiet = self.quiet()
        own_p95, step_s = pct(quiet, 0.95), statistics.median(quiet)
        prompt = self._tokens(self.args.prompt_tokens)
        cpu = time.process_time()
        alone = self.prefill(self.decoder, prompt, ALONE_CHUNK)
        cores_alone, cpu = (time.process_time() - cpu) / alone, time.process_time()
        if arm.kind == "mixed":
            took, gaps = self.mixed(prompt, arm.size)
        else:
            took, gaps = self.laned(prompt, arm, step_s)
        cores = (time.process_time() - cpu) / took
        return {"own_p95_ms": own_p95 * 1e3, "alone_s": alone, "ttft_s": took,
                "ttft_over_alone": took / alone, "steps": len(gaps),
                "cores_alone": cores_alone, "cores": cores,
                **{f"{name}_over_own": value / own_p95 for name, value in (
                    ("p50", statistics.median(gaps)), ("p95", pct(gaps, 0.95)),
                    ("p99", pct(gaps, 0.99)), ("max", max(gaps)))}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default="mixed:32,mixed:64,lane:256:3,queued:256:3",
                   help="comma-separated arms (mixed:S, lane:C:P, queued:C:P)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rows", type=int, default=4, help="decoding streams (4)")
    p.add_argument("--row-context", type=int, default=1500, metavar="N",
                   help="each stream's context when an arm starts (1500)")
    p.add_argument("--row-max-tokens", type=int, default=8192, metavar="N")
    p.add_argument("--prompt-tokens", type=int, default=10_000, metavar="N")
    p.add_argument("--quiet-steps", type=int, default=150, metavar="N")
    p.add_argument("--lane-nice", type=int, default=0, metavar="N",
                   help="the lane thread's nice value (and its MLX streams' threads')")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print the runs as JSON too")
    args = p.parse_args()
    try:
        arms = [parse_arm(a) for a in args.arms.split(",")]
    except ValueError as exc:
        p.error(str(exc))
    if args.rounds < 1 or args.rows < 1 or args.prompt_tokens < 2:
        p.error("--rounds and --rows must be >= 1, --prompt-tokens >= 2")
    bench = Bench(args)
    runs: dict[str, list[dict[str, float]]] = {a.label: [] for a in arms}
    for r in range(args.rounds):
        for arm in arms[r % len(arms):] + arms[: r % len(arms)]:
            res = bench.run_arm(arm)
            runs[arm.label].append(res)
            print(f"round {r + 1} {arm.label:>14}: TTFT / alone {res['ttft_over_alone']:.2f} "
                  f"(alone {res['alone_s']:.2f} s); gaps / own p95 (own {res['own_p95_ms']:.1f}"
                  f" ms): p50 {res['p50_over_own']:.2f} p95 {res['p95_over_own']:.2f} "
                  f"p99 {res['p99_over_own']:.2f} max {res['max_over_own']:.2f}; cores in use "
                  f"{res['cores']:.2f} (alone {res['cores_alone']:.2f})", flush=True)
    bench.lane.close()
    print("\n| arm | TTFT / alone | p50 / own | p95 / own | p99 / own | max / own | cores "
          "| cores alone |")
    print("|---|---|---|---|---|---|---|---|")
    for label, rs in runs.items():
        cells = []
        for key in ("ttft_over_alone", "p50_over_own", "p95_over_own", "p99_over_own",
                    "max_over_own", "cores", "cores_alone"):
            vals = [x[key] for x in rs]
            cells.append(f"{statistics.median(vals):.2f} [{min(vals):.2f}, {max(vals):.2f}]")
        print(f"| {label} | " + " | ".join(cells) + " |")
    if args.json:
        print(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
