"""The optimized BLAS against MLX's bundled reference BLAS, side by side in one run.

    .venv/bin/python scripts/bench_blas.py [--rounds 2] [--tokens 1,16,64,512]
        [--contexts 0,8000] [--ttft-prompt-tokens 10000] [--arms auto,reference]

Each arm is a fresh process with FAIRTICK_BLAS set to one of --arms ('auto' = the optimized
BLAS, 'reference', or a library's path), the arms' order reversed every round (A B, then B A,
...). A child process measures float32
GEMM GFLOP/s (1024^3) and one forward of t prompt tokens through the built-in model against a
KV cache already holding c tokens (median over repeats, the cache trimmed back after each).
Then, unless --ttft-prompt-tokens is 0, `fairtick serve --blas ARM` (default flags otherwise)
is started per arm, alternated the same way, and the time to first token of one prompt of that
many tokens on the idle server is measured. Prints each arm's median and, beside each, how
many times faster than the last arm it is (the reference BLAS by default).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

def child(tokens: list[int], contexts: list[int]) -> dict[str, Any]:
    """Measurements in this process, on the BLAS $FAIRTICK_BLAS names."""
    from runtime.blas import load_blas

    blas = load_blas()
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from runtime.model import load_model

    a = mx.random.normal((1024, 1024))
    gemm_s = _median_s(lambda: mx.eval(a @ a), 5)
    model = load_model(None).model
    rng = random.Random(0)
    forward_ms: dict[str, float] = {}
    for context in contexts:
        cache = make_prompt_cache(model)
        for start in range(0, context, 512):
            n = min(512, context - start)
            model(mx.array([rng.randrange(32, 127) for _ in range(n)])[None], cache=cache)
            mx.eval([c.state for c in cache])
        for t in tokens:
            x = mx.array([rng.randrange(32, 127) for _ in range(t)])[None]
            forward = partial(_forward, model, x, cache, trim_prompt_cache)
            forward_ms[f"{t}@{context}"] = _median_s(forward, max(3, min(20, 512 // t))) * 1e3
    return {"blas": blas.describe(), "gemm_gflops": 2 * 1024**3 / gemm_s / 1e9,
            "forward_ms": forward_ms}


def _forward(model: Any, x: Any, cache: Any, trim: Any) -> None:
    """One forward of x's tokens after the cache's; the cache is trimmed back after it."""
    import mlx.core as mx

    mx.eval(model(x, cache=cache))
    trim(cache, x.shape[1])


def _median_s(work: Any, reps: int) -> float:
    work()  # warm-up
    times = []
    for _ in range(reps):
        tic = time.perf_counter()
        work()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def run_child(arm: str, tokens: str, contexts: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", "--tokens", tokens, "--contexts", contexts]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "FAIRTICK_BLAS": arm}, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"child ({arm}) failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.splitlines()[-1]))


def ttft_s(arm: str, prompt_tokens: int, log_dir: Path) -> float:
    """TTFT of one prompt of `prompt_tokens` tokens on an idle `fairtick serve --blas arm`."""
    from benchlib.client import TimedStream
    from benchlib.serve import start_server, stop_server

    server = start_server(["--blas", arm], log_dir / f"serve-{arm}.log")
    try:
        # The built-in model's tokenizer is byte-level: one printable character, one token.
        rng = random.Random(prompt_tokens)
        prompt = "".join(chr(rng.randrange(32, 127)) for _ in range(prompt_tokens - 1))
        stream = TimedStream(server.url, prompt, max_tokens=2, timeout_s=600).start()
        stream.join(600)
        if stream.ttft_s is None:
            raise RuntimeError(f"no first token ({stream.error}):\n{server.log_tail()}")
        return stream.ttft_s
    finally:
        stop_server(server)


def arm_order(arms: list[str], round_index: int) -> list[str]:
    """A B, then B A: neither arm always runs first."""
    return arms if round_index % 2 == 0 else arms[::-1]


def print_row(label: str, values: dict[str, float], unit: str, arms: list[str],
              higher_is_better: bool) -> None:
    base = values[arms[-1]]
    cells = []
    for arm in arms:
        speedup = values[arm] / base if higher_is_better else base / values[arm]
        cells.append(f"{values[arm]:>9.{1 if unit != 's' else 2}f}{unit} {speedup:>5.1f}x")
    print(f"{label:>20} " + " ".join(f"{c:>18}" for c in cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", default="1,16,64,512", help="prompt tokens per forward")
    p.add_argument("--contexts", default="0,8000", help="tokens already in the KV cache")
    p.add_argument("--ttft-prompt-tokens", type=int, default=10000, metavar="N",
                   help="prompt length for the idle-server TTFT (0: skip)")
    p.add_argument("--arms", default="auto,reference",
                   help="FAIRTICK_BLAS values to compare; ratios are against the last")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.child:
        print(json.dumps(child(tokens, contexts)))
        return
    arms = args.arms.split(",")
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    for r in range(args.rounds):
        for arm in arm_order(arms, r):
            runs[arm].append(run_child(arm, args.tokens, args.contexts))
    for i, arm in enumerate(arms):
        print(f"arm {i + 1}: {arm}: {runs[arm][0]['blas']}")
    print(f"\n{'':>20} " + " ".join(f"{f'arm {i + 1}':>18}" for i in range(len(arms))))
    gemm = {arm: statistics.median(run["gemm_gflops"] for run in runs[arm]) for arm in arms}
    print_row("GEMM GFLOP/s", gemm, "", arms, higher_is_better=True)
    for key in runs[arms[0]][0]["forward_ms"]:
        ms = {arm: statistics.median(run["forward_ms"][key] for run in runs[arm]) for arm in arms}
        t, c = key.split("@")
        print_row(f"forward t={t} c={c}", ms, "ms", arms, higher_is_better=False)
    if args.ttft_prompt_tokens > 0:
        ttft: dict[str, list[float]] = {arm: [] for arm in arms}
        with tempfile.TemporaryDirectory(prefix="bench-blas-") as logs:
            for r in range(args.rounds):
                for arm in arm_order(arms, r):
                    ttft[arm].append(ttft_s(arm, args.ttft_prompt_tokens, Path(logs)))
        med = {arm: statistics.median(ttft[arm]) for arm in arms}
        print_row(f"TTFT {args.ttft_prompt_tokens} tokens", med, "s", arms,
                  higher_is_better=False)
        print("TTFT runs: " + "; ".join(f"arm {i + 1}: " + ", ".join(f"{t:.2f}s" for t in ttft[a])
                                        for i, a in enumerate(arms)))


if __name__ == "__main__":
    main()
