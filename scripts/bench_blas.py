"""The optimized BLAS against MLX's bundled reference BLAS, side by side in one run.

    .venv/bin/python scripts/bench_blas.py [--rounds 2] [--tokens 1,16,64,512]
        [--contexts 0,8000] [--ttft-prompt-tokens 10000]

Each arm is a fresh process with FAIRTICK_BLAS set ('auto' = the optimized BLAS, 'reference'),
the arms alternated for --rounds rounds (A B, then B A, ...). A child process measures float32
GEMM GFLOP/s (1024^3) and one forward of t prompt tokens through the built-in model against a
KV cache already holding c tokens (median over repeats, the cache trimmed back after each).
Then, unless --ttft-prompt-tokens is 0, `fairtick serve --blas ARM` (default flags otherwise)
is started per arm, alternated the same way, and the time to first token of one prompt of that
many tokens on the idle server is measured. Prints each arm's median and the reference/optimized
ratio.
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

ARMS = ("auto", "reference")


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


def arm_order(round_index: int) -> tuple[str, ...]:
    """A B, then B A: neither arm always runs first."""
    return ARMS if round_index % 2 == 0 else ARMS[::-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", default="1,16,64,512", help="prompt tokens per forward")
    p.add_argument("--contexts", default="0,8000", help="tokens already in the KV cache")
    p.add_argument("--ttft-prompt-tokens", type=int, default=10000, metavar="N",
                   help="prompt length for the idle-server TTFT (0: skip)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.child:
        print(json.dumps(child(tokens, contexts)))
        return
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        for arm in arm_order(r):
            runs[arm].append(run_child(arm, args.tokens, args.contexts))
    for arm in ARMS:
        print(f"{arm:>9}: {runs[arm][0]['blas']}")
    print(f"\n{'':>16} {'optimized':>10} {'reference':>10} {'ref/opt':>8}")
    gemm = {arm: statistics.median(run["gemm_gflops"] for run in runs[arm]) for arm in ARMS}
    print(f"{'GEMM GFLOP/s':>16} {gemm['auto']:>10.1f} {gemm['reference']:>10.1f} "
          f"{gemm['auto'] / gemm['reference']:>7.1f}x")
    for key in runs["auto"][0]["forward_ms"]:
        ms = {arm: statistics.median(run["forward_ms"][key] for run in runs[arm]) for arm in ARMS}
        t, c = key.split("@")
        print(f"{f'forward t={t} c={c}':>16} {ms['auto']:>8.1f}ms {ms['reference']:>8.1f}ms "
              f"{ms['reference'] / ms['auto']:>7.1f}x")
    if args.ttft_prompt_tokens > 0:
        ttft: dict[str, list[float]] = {arm: [] for arm in ARMS}
        with tempfile.TemporaryDirectory(prefix="bench-blas-") as logs:
            for r in range(args.rounds):
                for arm in arm_order(r):
                    ttft[arm].append(ttft_s(arm, args.ttft_prompt_tokens, Path(logs)))
        med = {arm: statistics.median(ttft[arm]) for arm in ARMS}
        print(f"{f'TTFT {args.ttft_prompt_tokens} tok':>16} {med['auto']:>9.2f}s "
              f"{med['reference']:>9.2f}s {med['reference'] / med['auto']:>7.1f}x   "
              f"(each run: {', '.join(f'{a} {t:.2f}s' for a in ARMS for t in ttft[a])})")


if __name__ == "__main__":
    main()
