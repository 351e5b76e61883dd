#!/usr/bin/env python3
"""Where attention's time goes on MLX's CPU build: the product form, `exp`, and the kernel.

Times, on the built-in model's attention shape (4 query heads, 2 KV heads, head dim 32), one
layer's attention for r rows of t query tokens each at context c (t > 1 with the causal mask,
r > 1 with a boolean mask as a decode batch has): `mx.fast.scaled_dot_product_attention` and
fairtick's `runtime.attention.attend` (the same ops, the query heads of a group folded into one
product) with MLX's softmax, with the fast one in MLX's ops, and (a slice: t > 1) with the
slice-attention kernel (runtime/native.py); MLX's softmax, the fast softmax and `exp` over the
same scores, and numpy's `exp` on the same array. Medians of --reps runs, milliseconds.

    .venv/bin/python scripts/bench_attention_cpu.py [--contexts 2000,8000] [--tokens 2,16,64]
        [--rows 1]
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


def time_shape(c: int, t: int, r: int, reps: int) -> tuple[float, ...]:
    """(SDPA, attend, attend with the fast softmax's ops, attend with the kernel, softmax, fast
    softmax, mx.exp, numpy exp) ms for r rows of t queries at context c, and whether attend's
    output (MLX's softmax) equals SDPA's bit for bit (1.0 or 0.0)."""
    import mlx.core as mx  # after runtime (main), which loads the BLAS before MLX

    from runtime import attention, native
    from runtime.attention import attend, softmax

    q = mx.random.normal((r, HEADS, t, HEAD_DIM))
    k, v = (mx.random.normal((r, KV_HEADS, c + t, HEAD_DIM)) for _ in range(2))
    scores = mx.random.normal((r, HEADS, t, c + t))
    # A decode batch's mask: row i's first i keys are padding.
    mask: mx.array | str | None = "causal" if t > 1 else None
    if r > 1 and t == 1:
        mask = (mx.arange(c + t)[None] >= mx.arange(r)[:, None])[:, None, None, :]
    mx.eval(q, k, v, scores)
    host = np.array(scores)
    scale = HEAD_DIM ** -0.5
    fast = attention.FAST_SOFTMAX
    attention.FAST_SOFTMAX = False
    ours = attend(q, k, v, None, scale, mask)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    times = [median_ms(lambda: mx.eval(mx.fast.scaled_dot_product_attention(
                 q, k, v, scale=scale, mask=mask)), reps),
             median_ms(lambda: mx.eval(attend(q, k, v, None, scale, mask)), reps)]
    attention.FAST_SOFTMAX = fast
    kernel = native.slice_attention() if fast and t > 1 else None

    def fast_ops() -> None:
        native.slice_attention = lambda: None  # attend's ops: the kernel's absence
        try:
            mx.eval(attend(q, k, v, None, scale, mask))
        finally:
            native.slice_attention = found

    found = native.slice_attention
    times.append(median_ms(fast_ops, reps) if fast else float("nan"))
    times.append(median_ms(lambda: mx.eval(attend(q, k, v, None, scale, mask)), reps)
                 if kernel is not None else float("nan"))
    times += [median_ms(lambda: mx.eval(mx.softmax(scores, axis=-1, precise=True)), reps),
              median_ms(lambda: mx.eval(softmax(scores)), reps) if fast else float("nan"),
              median_ms(lambda: mx.eval(mx.exp(scores)), reps),
              median_ms(lambda: np.exp(host), reps)]
    return (*times, float(mx.array_equal(ours, theirs).item()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="2000,8000")
    p.add_argument("--tokens", default="2,16,64")
    p.add_argument("--rows", default="1", help="rows of t queries (a decode batch: t = 1)")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    import runtime  # noqa: F401  (loads the BLAS before MLX is imported)
    from runtime import native
    from runtime.attention import fast_softmax_reason

    reason = fast_softmax_reason()
    print(f"fast softmax: {'no (' + reason + ')' if reason else 'yes'}")
    kernel_reason = native.reason()
    print(f"slice-attention kernel: {'no (' + kernel_reason + ')' if kernel_reason else 'yes'}")
    print("| rows | c | t | SDPA ms | attend ms | attend / SDPA | bit-equal | attend, fast "
          "softmax ms | / SDPA | kernel ms | kernel / fast softmax | softmax ms | "
          "fast softmax ms | mx.exp ms | numpy exp ms |")
    print("|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in (int(x) for x in args.rows.split(",")):
        for c in (int(x) for x in args.contexts.split(",")):
            for t in (int(x) for x in args.tokens.split(",")):
                sdpa, ours, fast, kernel, soft, fast_soft, exp, npexp, equal = time_shape(
                    c, t, r, args.reps)
                print(f"| {r} | {c} | {t} | {sdpa:.2f} | {ours:.2f} | {ours / sdpa:.2f} | "
                      f"{'yes' if equal else 'no'} | {fast:.2f} | {fast / sdpa:.2f} | "
                      f"{kernel:.2f} | {kernel / fast:.2f} | "
                      f"{soft:.2f} | {fast_soft:.2f} | {exp:.2f} | {npexp:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
