#!/usr/bin/env python3
"""The admission scenario for a list of arms (policy + serve flags), side by side.

For each arm: start `fairtick serve` on a free 127.0.0.1 port, measure R times with the same
layout, stop it. Prints a markdown table of medians [min, max] over the comparable runs (the
quiet window's tokens/s is the steady-state decode throughput with no admission) and writes
OUT/admission.md, OUT/admission.json, OUT/admission.png (TTFT / TTFT alone against admission
p95 inflation, one point per arm) and one server log per arm. Exit 0 when every run was
comparable, 2 when some was not (the table says which and why).

An arm is 'LABEL=POLICY [SERVE FLAGS...]' or 'POLICY [SERVE FLAGS...]', e.g.
    --arm 'gc4=grant_counter --grant-interval 4' --arm mixed_step

Small run (~1-2 min per arm):
    .venv/bin/python scripts/bench_admission_matrix.py --prompt-tokens 1500 --chunk 128 \\
        --settle-s 2 --repeats 3 --arm mixed_step --arm 'gc4=grant_counter --grant-interval 4'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

from benchlib.admission import run_admission
from benchlib.attribution import NotComparable
from benchlib.client import ServerError
from benchlib.options import add_admission_options, config_from_args
from benchlib.report import ArmRuns, format_matrix, plot_frontier, to_jsonable
from benchlib.serve import start_server, stop_server

DEFAULT_ARMS = ["deadline", "tb3=token_budget --itl-factor 3",
                "tb375=token_budget --itl-factor 3.75", "tb4=token_budget",
                "tb45=token_budget --itl-factor 4.5", "tb5=token_budget --itl-factor 5",
                "tb7=token_budget --itl-factor 7", "lane=token_budget_lane",
                "mixed_step",
                "gc16=grant_counter --grant-interval 16", "prefill_priority", "baseline"]


def parse_arm(text: str) -> ArmRuns:
    """'LABEL=POLICY FLAGS...' or 'POLICY FLAGS...'; ValueError if empty."""
    words = shlex.split(text)
    if not words:
        raise ValueError("an --arm needs at least a policy name or path")
    label, sep, policy = words[0].partition("=")
    if not sep or label.startswith("-"):
        label, policy = " ".join(words), words[0]
    return ArmRuns(label=label, policy=policy, flags=words[1:])


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arm", action="append", default=[], metavar="'[LABEL=]POLICY FLAGS'",
                   help="an arm (repeatable; default: every shipped policy, token_budget at six "
                   "targets)")
    p.add_argument("--repeats", type=int, default=3, metavar="R", help="runs per arm (3)")
    p.add_argument("--chunk", type=int, default=512, metavar="N",
                   help="--prefill-chunk-size of every arm (512)")
    p.add_argument("--max-running", type=int, default=None, metavar="N",
                   help="--max-running of every arm (default: the server's default)")
    p.add_argument("--serve-flags", default="", metavar="'FLAGS'",
                   help="more `fairtick serve` flags for every arm, e.g. '--model PATH'")
    p.add_argument("--alone-per-arm", action="store_true",
                   help="measure the prompt alone in each arm's first run only and reuse it")
    p.add_argument("--out", type=Path, default=Path("bench-out"), metavar="DIR",
                   help="where the table, JSON, plot and server logs go (bench-out)")
    add_admission_options(p)
    return p


def run_arm(arm: ArmRuns, args: argparse.Namespace, out: Path) -> None:
    """Start the arm's server, measure it args.repeats times, stop it."""
    running = ["--max-running", str(args.max_running)] if args.max_running else []
    flags = ["--policy", arm.policy, *running, "--prefill-chunk-size", str(args.chunk),
             *shlex.split(args.serve_flags), *arm.flags]
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in arm.label)
    try:
        server = start_server(flags, out / f"serve-{safe}.log")
    except RuntimeError as exc:
        arm.refused.append(f"the server did not start: {exc}")
        return
    try:
        cfg = config_from_args(args, server.url)
        for i in range(args.repeats):
            if args.alone_per_arm and arm.results:
                cfg = dataclasses.replace(cfg, ttft_alone_s=arm.results[0].ttft_alone_s)
            started = time.monotonic()
            try:
                arm.results.append(run_admission(dataclasses.replace(cfg, seed=args.seed + i)))
                verdict = "ok"
            except NotComparable as exc:
                arm.refused.append(str(exc))
                verdict = f"NOT COMPARABLE: {exc}"
            except (ServerError, TimeoutError, OSError) as exc:
                arm.refused.append(f"run failed: {exc}")
                verdict = f"failed: {exc}"
            print(f"[{arm.label}] run {i + 1}/{args.repeats}: {verdict} "
                  f"({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    finally:
        stop_server(server)


def write_outputs(arms: list[ArmRuns], args: argparse.Namespace, table: str) -> None:
    out: Path = args.out
    layout = (f"{args.streams} streams, prompt {args.prompt_tokens} tokens, chunk {args.chunk}, "
              f"settle {args.settle_s} s, {args.repeats} repeats")
    command = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
    machine = f"{platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    doc = [f"# Admission matrix, {time.strftime('%Y-%m-%d %H:%M')}", "", f"- layout: {layout}",
           f"- machine: {machine}", f"- command: `{command}`", "", table, ""]
    (out / "admission.md").write_text("\n".join(doc))
    (out / "admission.json").write_text(json.dumps(to_jsonable(arms), indent=1))
    plot_frontier(arms, out / "admission.png", f"Admission frontier ({layout})")


def main(argv: list[str] | None = None) -> int:
    p = make_parser()
    args = p.parse_args(argv)
    try:
        arms = [parse_arm(a) for a in (args.arm or DEFAULT_ARMS)]
        config_from_args(args, "http://127.0.0.1:1")
    except ValueError as exc:
        p.error(str(exc))
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    for arm in arms:
        run_arm(arm, args, args.out)
    table = format_matrix(arms)
    write_outputs(arms, args, table)
    print(table)
    print(f"\nwrote {args.out / 'admission.md'}, admission.json, admission.png")
    return 2 if any(a.refused for a in arms) else 0


if __name__ == "__main__":
    sys.exit(main())
