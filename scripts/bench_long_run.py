#!/usr/bin/env python3
"""Minutes of streaming through one `fairtick serve`: the tail a short benchmark cannot see.

    .venv/bin/python scripts/bench_long_run.py [--duration-s 240] [--streams 4]
        [--stream-tokens 3000] [--prompt-every-s 30] [--prompt-tokens 4000]
        [--serve-flags '...' | --url http://127.0.0.1:PORT] [--json FILE]

Starts `fairtick serve` at default flags (or --serve-flags; or uses a running server at --url)
and keeps --streams greedy streams of --stream-tokens tokens decoding for --duration-s, each
restarted with a new prompt as it ends, so rows leave and join the batch all the time; every
--prompt-every-s a prompt of --prompt-tokens tokens arrives beside them (0: none). A server
that lives ~40 s, as the admission benchmark's do, never shows what comes every minute or two:
Python's full collections, a row leaving a long batch, memory given back; and the admission
benchmark's prompt asks for one token, so it never joins the streams' batch. Prints the pooled
inter-token gaps (p50/p95/p99/p99.9/max and max / p95) of all gaps, of the streams' own (no
prompt alive) and of those beside a prompt (from its request to its last token: its prefill,
its joining the decode batch and its leaving it), the worst gaps with when they came, the
prompts' TTFT, the server's garbage collections (from /debug/state) and the decode rate.
Exit 1 when a request failed.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchlib.admission import make_prompt
from benchlib.client import TimedStream, get_json
from benchlib.long_run import TailStats, classify_gaps, over, worst
from benchlib.serve import start_server, stop_server
from benchlib.windows import Window


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=240.0, metavar="S",
                   help="how long the streams run (240)")
    p.add_argument("--streams", type=int, default=4, help="concurrent streams (4)")
    p.add_argument("--stream-tokens", type=int, default=3000, metavar="N",
                   help="max_tokens of each stream's request (3000)")
    p.add_argument("--stream-prompt-tokens", type=int, default=64, metavar="N",
                   help="the streams' prompts (64)")
    p.add_argument("--prompt-every-s", type=float, default=30.0, metavar="S",
                   help="a long prompt arrives this often, the first half a period in (30; 0: "
                   "none)")
    p.add_argument("--prompt-tokens", type=int, default=4000, metavar="N",
                   help="the long prompts (4000)")
    p.add_argument("--prompt-max-tokens", type=int, default=8, metavar="N",
                   help="max_tokens of each long prompt (8)")
    p.add_argument("--worst", type=int, default=8, metavar="N", help="worst gaps listed (8)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--url", help="a running server instead of starting one")
    group.add_argument("--serve-flags", default="", metavar="'FLAGS'",
                       help="`fairtick serve` flags (default flags)")
    p.add_argument("--out", type=Path, default=Path("bench-out"), metavar="DIR",
                   help="where the server's log goes (bench-out)")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)
    for name in ("duration_s", "streams", "stream_tokens", "stream_prompt_tokens",
                 "prompt_tokens", "prompt_max_tokens"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.prompt_every_s < 0:
        p.error(f"--prompt-every-s must be 0 (no prompts) or more, got {args.prompt_every_s}")
    return args


@dataclass
class Run:
    """What the clients recorded: each finished request's token times (streams), each long
    prompt's life (request sent, last token) and its TTFT."""

    t0_s: float
    streams: list[list[float]] = field(default_factory=list)
    prompts: list[Window] = field(default_factory=list)
    ttfts_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, stream: TimedStream, prompt: bool) -> None:
        with self.lock:
            if stream.error:
                self.errors.append(stream.error)
            if prompt and stream.sent_s is not None and stream.times_s:
                self.prompts.append(Window(stream.sent_s, stream.times_s[-1]))
                self.ttfts_s.append(stream.times_s[0] - stream.sent_s)
            elif not prompt:
                self.streams.append(list(stream.times_s))


def _keep_streaming(url: str, slot: int, args: argparse.Namespace, run: Run,
                    end_s: float) -> None:
    """One stream after another until end_s; the last is closed there."""
    for k in range(10**9):
        if time.monotonic() >= end_s:
            return
        prompt = make_prompt(args.stream_prompt_tokens, seed=1_000_000 * slot + k)
        stream = TimedStream(url, prompt, args.stream_tokens, timeout_s=120).start()
        while not stream.join(0.2):
            if time.monotonic() >= end_s:
                stream.close()
        run.add(stream, prompt=False)


def _send_prompts(url: str, args: argparse.Namespace, run: Run, end_s: float) -> None:
    """A long prompt every args.prompt_every_s, the first half a period in."""
    due_s = run.t0_s + args.prompt_every_s / 2
    for k in range(10**9):
        time.sleep(max(0.0, due_s - time.monotonic()))
        if time.monotonic() >= end_s:
            return
        stream = TimedStream(url, make_prompt(args.prompt_tokens, seed=-1 - k),
                             args.prompt_max_tokens, timeout_s=300).start()
        stream.join(300)
        run.add(stream, prompt=True)
        due_s += args.prompt_every_s


def measure(url: str, args: argparse.Namespace) -> Run:
    run = Run(time.monotonic())
    end_s = run.t0_s + args.duration_s
    threads = [threading.Thread(target=_keep_streaming, args=(url, i, args, run, end_s))
               for i in range(args.streams)]
    if args.prompt_every_s:
        threads.append(threading.Thread(target=_send_prompts, args=(url, args, run, end_s)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return run


def _row(name: str, s: TailStats) -> str:
    return (f"| {name} | {s.num_gaps} | {s.p50_ms:.1f} | {s.p95_ms:.1f} | {s.p99_ms:.1f} | "
            f"{s.p999_ms:.1f} | {s.max_ms:.1f} | {s.max_over_p95:.1f}x |")


def report(run: Run, gc_before: list[int], gc_after: list[int],
           args: argparse.Namespace) -> dict:
    gaps = classify_gaps(run.streams, run.prompts, run.t0_s)
    own = [g for g in gaps if not g.during_prompt]
    beside = [g for g in gaps if g.during_prompt]
    stats = {"all": TailStats.of(gaps), "own": TailStats.of(own),
             "beside a prompt": TailStats.of(beside)}
    ttfts = run.ttfts_s
    tokens = sum(len(s) for s in run.streams)
    collections = [a - b for a, b in zip(gc_after, gc_before, strict=True)]
    lines = [f"{args.streams} streams of up to {args.stream_tokens} tokens for "
             f"{args.duration_s:.0f} s ({len(run.streams)} requests, {tokens} tokens, "
             f"{tokens / args.duration_s:.0f} tokens/s); {len(run.prompts)} prompts of "
             f"{args.prompt_tokens} tokens", "",
             "| gaps | n | p50 ms | p95 ms | p99 ms | p99.9 ms | max ms | max / p95 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|",
             *[_row(name, s) for name, s in stats.items()], "",
             f"own gaps over 10x their p95: {over(own, 10 * stats['own'].p95_ms)}",
             "worst gaps (s into the run, ms, beside a prompt): " + ", ".join(
                 f"{g.start_s:.1f} s {g.ms:.1f}{' P' if g.during_prompt else ''}"
                 for g in worst(gaps, args.worst)),
             "prompts' TTFT: " + (f"median {statistics.median(ttfts):.2f} s, max "
                                   f"{max(ttfts):.2f} s" if ttfts else "none"),
             f"server's garbage collections by generation: {collections}"]
    if run.errors:
        lines.append(f"FAILED requests ({len(run.errors)}): {run.errors[:3]}")
    print("\n".join(lines))
    return {"args": {k: str(v) for k, v in vars(args).items()},
            "gaps": {k: asdict(v) for k, v in stats.items()},
            "worst": [asdict(g) for g in worst(gaps, args.worst)],
            "ttft_s": ttfts, "tokens": tokens, "gc_collections": collections,
            "errors": run.errors}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    server = None
    if args.url is None:
        server = start_server(shlex.split(args.serve_flags), args.out / "serve-long-run.log")
    url = args.url or server.url
    try:
        gc_before = get_json(url, "/debug/state")["memory"]["gc_collections"]
        run = measure(url, args)
        gc_after = get_json(url, "/debug/state")["memory"]["gc_collections"]
    finally:
        if server is not None:
            stop_server(server)
    result = report(run, gc_before, gc_after, args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 1 if run.errors else 0


if __name__ == "__main__":
    sys.exit(main())
