#!/usr/bin/env python3
"""Where a prefill slice's time goes on MLX's CPU build: attention against `exp`.

Times, on the built-in model's attention shape (4 query heads, 2 KV heads, head dim 32), one
layer's `mx.fast.scaled_dot_product_attention` for t query tokens at context c, and the
softmax and `exp` over the same scores, beside numpy's `exp` on the same array. Medians of
--reps runs, milliseconds.

    .venv/bin/python scripts/bench_attention_cpu.py [--contexts 2000,8000] [--tokens 2,16,64]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32


def median_ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def time_shape(c: int, t: int, reps: int) -> tuple[float, float, float, float]:
    """(SDPA, softmax, mx.exp, numpy exp) ms for t queries at context c."""
    import mlx.core as mx  # after runtime (main), which loads the BLAS before MLX

    q = mx.random.normal((1, HEADS, t, HEAD_DIM))
    k, v = (mx.random.normal((1, KV_HEADS, c + t, HEAD_DIM)) for _ in range(2))
    scores = mx.random.normal((1, HEADS, t, c + t))
    mx.eval(q, k, v, scores)
    host = np.array(scores)
    return (median_ms(lambda: mx.eval(mx.fast.scaled_dot_product_attention(
                q, k, v, scale=HEAD_DIM ** -0.5, mask="causal")), reps),
            median_ms(lambda: mx.eval(mx.softmax(scores, axis=-1)), reps),
            median_ms(lambda: mx.eval(mx.exp(scores)), reps),
            median_ms(lambda: np.exp(host), reps))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="2000,8000")
    p.add_argument("--tokens", default="2,16,64")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    import runtime  # noqa: F401  (loads the BLAS before MLX is imported)

    print("| c | t | SDPA ms | softmax of scores ms | mx.exp ms | numpy exp ms | exp / SDPA |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for c in (int(x) for x in args.contexts.split(",")):
        for t in (int(x) for x in args.tokens.split(",")):
            sdpa, soft, exp, npexp = time_shape(c, t, args.reps)
            print(f"| {c} | {t} | {sdpa:.2f} | {soft:.2f} | {exp:.2f} | {npexp:.2f} | "
                  f"{exp / sdpa:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
