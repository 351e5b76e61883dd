"""Steady decode tokens/s of `fairtick serve` against mlx_lm.server and a bare mlx-lm loop.

    .venv/bin/python scripts/bench_throughput.py [--streams 4,16] [--rounds 2]
        [--from-token 256] [--to-token 1024] [--fairtick-flags "--max-running 16"]
        [--mlx-lm-blas shipped|same] [--json FILE]

For each stream count S, `fairtick serve` (default flags, or --fairtick-flags) and
`python -m mlx_lm.server --model DIR` (its defaults) serve the same model directory (the
built-in model) one after the other, alternated over rounds (A B, then B A). S streamed greedy
completions with a max_tokens far beyond the window are sent at once. The window is counted in
tokens, not seconds: it opens when every stream has its --from-token-th token and closes when
the first has its --to-token-th, and the tokens of all streams that arrive inside it, per
second, are the arm's rate. So every arm is measured decoding at the same contexts (the prompt
plus 256 .. 1024 tokens by default): a decode step's cost grows with its context (at 4 rows
~1.5x from 750 to 1,200 keys here), and a window in seconds would measure the faster server at
a longer context than the slower one. The third arm, in the same alternation (A B C, then
C B A), is a bare in-process mlx-lm decode loop (BatchKVCache, greedy, pipelined:
scripts/bench_decode_kernel.py) decoding as many rows as there are streams, from the context
the window opens at, for as many steps as the window spans, on the same BLAS (this process and
the fairtick server both load the one $FAIRTICK_BLAS names). Prints each arm's median, the
ratios fairtick / mlx_lm.server (goal >= 2) and fairtick / bare (goal >= 0.9), the window's
inter-token gaps (p50/p95/p99/max), and the machine's load average.

mlx_lm.server runs on the BLAS its wheel ships (`shipped`: on Linux the reference BLAS), or with
`--mlx-lm-blas same` on fairtick's, through LD_PRELOAD of the library runtime.blas loads.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_decode_kernel import bare_mlx_lm_decode_s  # noqa: E402  (imports runtime first)
from benchlib.client import TimedStream, get_json  # noqa: E402
from benchlib.report import to_jsonable  # noqa: E402
from benchlib.serve import Server, start_mlx_lm_server, start_server, stop_server  # noqa: E402
from benchlib.throughput import (  # noqa: E402
    Comparison,
    WindowRate,
    arm_order,
    format_table,
    median_rate,
    token_window,
    window_rate,
)

from runtime.blas import DEFAULT_THREADS, THREADS_ENV, load_blas  # noqa: E402
from runtime.model import ModelBundle, load_model, make_builtin_model  # noqa: E402

ARMS = ("fairtick", "mlx_lm", "bare")
GOAL_MLX_LM, GOAL_BARE = 2.0, 0.9
CONNECT_SPACING_S = 0.05


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options, checked: a bad one exits with a usage error naming it."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", default="4,16", help="concurrent streams per run (4,16)")
    p.add_argument("--rounds", type=int, default=2, help="A B rounds, alternated (2)")
    p.add_argument("--from-token", type=int, default=256,
                   help="the window opens when every stream has this many tokens (256)")
    p.add_argument("--to-token", type=int, default=1024,
                   help="and closes when the first has this many (1024)")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="give up on an arm whose streams do not reach --to-token by then (600)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (64)")
    p.add_argument("--max-tokens", type=int, default=8192,
                   help="max_tokens of each stream; must outlast the window (8192)")
    p.add_argument("--fairtick-flags", default="", metavar="FLAGS",
                   help="extra `fairtick serve` flags, one string (default: none)")
    p.add_argument("--mlx-lm-blas", choices=("shipped", "same"), default="shipped",
                   help="mlx_lm.server's BLAS: its wheel's own, or fairtick's (shipped)")
    p.add_argument("--json", metavar="FILE", default=None, help="also write every run here")
    args = p.parse_args(argv)
    try:
        args.streams = [int(s) for s in args.streams.split(",")]
    except ValueError:
        p.error(f"--streams must be comma-separated integers, got {args.streams!r}")
    for name, value, low in (("--streams", min(args.streams), 1), ("--rounds", args.rounds, 1),
                             ("--prompt-tokens", args.prompt_tokens, 1),
                             ("--max-tokens", args.max_tokens, 1)):
        if value < low:
            p.error(f"{name} must be >= {low}, got {value}")
    if not 0 < args.from_token < args.to_token < args.max_tokens:
        p.error(f"need 0 < --from-token < --to-token < --max-tokens, got {args.from_token}, "
                f"{args.to_token}, {args.max_tokens}")
    if not args.timeout_s > 0:
        p.error(f"--timeout-s must be > 0, got {args.timeout_s}")
    args.fairtick_flags = shlex.split(args.fairtick_flags)
    return args


def make_prompt(tokens: int, seed: int) -> str:
    # The built-in model's tokenizer is byte-level: one printable character, one token.
    rng = random.Random(seed)
    return "".join(chr(rng.randrange(32, 127)) for _ in range(tokens - 1))


def measure(server: Server, num_streams: int, args: argparse.Namespace) -> WindowRate:
    """The token-window rate of `num_streams` streams on a running server."""
    streams = []
    for i in range(num_streams):
        streams.append(TimedStream(server.url, make_prompt(args.prompt_tokens, i),
                                   args.max_tokens, timeout_s=120).start())
        # mlx_lm.server listens with Python's default backlog of 5: a burst of 16 connects
        # was reset once; spread them over a fraction of a second instead.
        time.sleep(CONNECT_SPACING_S)
    deadline_s = time.monotonic() + args.timeout_s
    try:
        while any(len(s.times_s) < args.to_token for s in streams):
            ended = [s for s in streams if s.ended]
            if ended:
                raise RuntimeError(f"{len(ended)} stream(s) ended before token "
                                   f"{args.to_token} ({ended[0].error or 'done'}); raise "
                                   f"--max-tokens:\n{server.log_tail()}")
            if time.monotonic() > deadline_s:
                raise RuntimeError(f"streams short of {args.to_token} tokens after "
                                   f"{args.timeout_s:.0f} s; raise --timeout-s")
            time.sleep(0.1)  # a benchmark's poll, not a test's clock
        times = [list(s.times_s) for s in streams]
        window = token_window(times, args.from_token, args.to_token)
        if window is None:
            raise RuntimeError(f"a stream had {args.to_token} tokens before another had "
                               f"{args.from_token}: the streams did not decode together")
        return window_rate(times, window)
    finally:
        for s in streams:
            s.close()
        for s in streams:
            s.join(30)


def run_arm(arm: str, num_streams: int, args: argparse.Namespace, model_dir: Path,
            log_dir: Path) -> tuple[WindowRate, str]:
    """One server start, one measurement, one stop; (the rate, the BLAS it ran on)."""
    log = log_dir / f"{arm}-{num_streams}-{time.monotonic_ns()}.log"
    if arm == "fairtick":
        server = start_server(["--model", str(model_dir), *args.fairtick_flags], log)
    else:
        env = dict(os.environ)
        if args.mlx_lm_blas == "same":
            # Its threads as runtime.blas sets them: a preload alone would run one per core.
            env["LD_PRELOAD"] = str(load_blas().preload)
            env.setdefault(THREADS_ENV, str(DEFAULT_THREADS))
        server = start_mlx_lm_server(model_dir, log, env=env)
    try:
        if arm == "fairtick":
            blas = get_json(server.url, "/debug/state")["blas"]
            blas_name = blas["config"] or blas["reason"]
        else:
            blas_name = "LD_PRELOAD " + str(load_blas().preload) if args.mlx_lm_blas == "same" \
                else "as its wheel ships it"
        return measure(server, num_streams, args), blas_name
    finally:
        stop_server(server)


@dataclass(frozen=True)
class BareRate:
    """The bare loop's rate through the servers' token window."""

    tokens_per_s: float
    rows: int
    context: int


def bare_rate(bundle: ModelBundle, rows: int, args: argparse.Namespace) -> BareRate:
    """The bare loop decoding `rows` rows through the servers' token window: from the context
    it opens at, for as many steps as it spans."""
    context = args.prompt_tokens + args.from_token
    steps = args.to_token - args.from_token
    rng = random.Random(rows)
    prompts = [[rng.randrange(32, 127) for _ in range(context)] for _ in range(rows)]
    return BareRate(rows / bare_mlx_lm_decode_s(bundle, prompts, steps), rows, context)


def run_round(n: int, r: int, args: argparse.Namespace, model_dir: Path, log_dir: Path,
              runs: dict[str, list[Any]], blas_names: dict[str, str]) -> None:
    """One round at `n` streams: the three arms in this round's order; appends to `runs`."""
    for arm in arm_order(ARMS, r):
        if arm == "bare":
            bare = bare_rate(_bundle(model_dir), n, args)
            runs[arm].append(bare)
            print(f"  {n:>3} streams, {arm:>8}: {bare.tokens_per_s:7.0f} tok/s ({bare.rows} rows, "
                  f"context {bare.context})", flush=True)
            continue
        rate, blas_names[arm] = run_arm(arm, n, args, model_dir, log_dir)
        runs[arm].append(rate)
        print(f"  {n:>3} streams, {arm:>8}: {rate.tokens_per_s:7.0f} tok/s "
              f"({rate.active_streams} decoding, context ~"
              f"{args.prompt_tokens + rate.tokens_before:.0f}; gaps p50/p95/p99/max "
              f"{rate.gaps.p50_ms:.0f}/{rate.gaps.p95_ms:.0f}/"
              f"{rate.gaps.p99_ms:.0f}/{rate.gaps.max_ms:.0f} ms)", flush=True)


@cache
def _bundle(model_dir: Path) -> ModelBundle:
    return load_model(model_dir)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    model_dir = make_builtin_model()
    if args.mlx_lm_blas == "same" and load_blas().preload is None:
        sys.exit(f"--mlx-lm-blas same: this machine has no optimized BLAS to share "
                 f"({load_blas().reason})")
    print(f"model {model_dir}; BLAS (fairtick, bare loop): {load_blas().describe()}")
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    runs: dict[int, dict[str, list[Any]]] = {}
    blas_names: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-throughput-") as logs:
        for n in args.streams:
            runs[n] = {arm: [] for arm in ARMS}
            for r in range(args.rounds):
                run_round(n, r, args, model_dir, Path(logs), runs[n], blas_names)
    rows = [Comparison(n, median_rate(runs[n]["fairtick"]), median_rate(runs[n]["mlx_lm"]),
                       median_rate(runs[n]["bare"]), runs[n]["bare"][-1].rows)
            for n in args.streams]
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print(f"fairtick serve {' '.join(args.fairtick_flags) or '(default flags)'}; mlx_lm.server "
          f"BLAS: {blas_names.get('mlx_lm')}; medians of {args.rounds} round(s)\n")
    print(format_table(rows, GOAL_MLX_LM, GOAL_BARE))
    if args.json:
        Path(args.json).write_text(json.dumps(to_jsonable(
            {"args": vars(args), "runs": runs, "comparisons": rows,
             "blas": load_blas().describe()}), indent=1, default=str))


if __name__ == "__main__":
    main()
