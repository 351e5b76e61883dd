"""The fast softmax against MLX's, in the engine's executor: alternated in one process.

    .venv/bin/python scripts/bench_softmax.py [--reps 3] [--rows 16] [--context 2000]
        [--small-rows 4] [--small-context 500] [--prompt-tokens 6000] [--slices 64,512]

Each rep runs, with MLX's softmax and then with the fast one (the order swapped every other
rep), on a fresh Executor over the built-in model: a decode step of --rows rows at context
--context and of --small-rows rows at --small-context (milliseconds a step, median of 15
steps), and a --prompt-tokens prompt prefilled in slices of each --slices size (seconds for the
whole prompt). Prints each measure's medians and the ratio fast / MLX (ADR 0014).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_decode_kernel import executor_decode_s, make_prompts  # noqa: E402

import runtime  # noqa: E402, F401  (loads the BLAS before MLX)
from runtime import attention  # noqa: E402
from runtime.executor import Executor  # noqa: E402
from runtime.model import ModelBundle, load_model, make_builtin_model  # noqa: E402
from runtime.sampling import SamplingParams  # noqa: E402


def prefill_s(bundle: ModelBundle, num_tokens: int, slice_tokens: int) -> float:
    ex = Executor(bundle)
    ex.add(0, make_prompts(1, num_tokens, 2)[0], SamplingParams(max_tokens=2))
    start, done = time.perf_counter(), 0
    while done < num_tokens:
        step = min(slice_tokens, num_tokens - done)
        ex.prefill(0, step)
        done += step
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--context", type=int, default=2000)
    p.add_argument("--small-rows", type=int, default=4)
    p.add_argument("--small-context", type=int, default=500)
    p.add_argument("--prompt-tokens", type=int, default=6000)
    p.add_argument("--slices", default="64,512")
    args = p.parse_args()
    reason = attention.fast_softmax_reason()
    if reason is not None:
        print(f"no fast softmax here ({reason}): nothing to compare")
        return 1
    bundle = load_model(make_builtin_model())
    slices = [int(s) for s in args.slices.split(",")]
    measures = {f"decode {args.rows} rows at {args.context} (ms/step)":
                lambda: 1e3 * executor_decode_s(bundle, make_prompts(args.rows, args.context, 1),
                                                15),
                f"decode {args.small_rows} rows at {args.small_context} (ms/step)":
                lambda: 1e3 * executor_decode_s(
                    bundle, make_prompts(args.small_rows, args.small_context, 1), 15)}
    for size in slices:
        measures[f"prefill {args.prompt_tokens} tokens in {size}-token slices (s)"] = \
            lambda size=size: prefill_s(bundle, args.prompt_tokens, size)
    got: dict[bool, dict[str, list[float]]] = {False: {}, True: {}}
    for rep in range(args.reps):
        for fast in (False, True) if rep % 2 == 0 else (True, False):
            attention.FAST_SOFTMAX = fast
            for name, measure in measures.items():
                got[fast].setdefault(name, []).append(measure())
            print(f"rep {rep + 1} {'fast' if fast else 'MLX '}: " + ", ".join(
                f"{v[-1]:.3g}" for v in got[fast].values()), flush=True)
    print("\n| measure | MLX softmax | fast softmax | fast / MLX |\n|---|---:|---:|---:|")
    for name in measures:
        mlx_s, fast_s = (statistics.median(got[f][name]) for f in (False, True))
        print(f"| {name} | {mlx_s:.3g} | {fast_s:.3g} | {fast_s / mlx_s:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
