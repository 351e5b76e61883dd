"""`fairtick check SPEC...`: prove a policy's claims by exhaustive search, in two layouts.

`streams`: streams that may decode forever, no KV limit (the worst case for fairness: the
defect this project exists for). `memory`: a KV budget and a finite max_tokens (the queue,
preemption and arrival claims). Exit 0: all hold; 1: a violation (the shortest counterexample,
replayed through the real Scheduler, is printed); 2: a spec or argument error, a spec the
checker cannot check exactly (with the reason), or --time-limit ran out.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Mapping
from typing import TextIO

from statemachine.abstraction import CannotCheck
from statemachine.argtypes import integer_at_least, seconds
from statemachine.checker import MEMORY, STREAMS, Checker, CheckLayout, Label, Report
from statemachine.counterexample import ReplayError, replay
from statemachine.invariants import UNIVERSAL
from statemachine.lifecycle import load_lifecycle
from statemachine.spec import CLAIMS, shipped_policy_names
from statemachine.tick import make_policy
from statemachine.trace import format_table, to_jsonl
from statemachine.yamlsrc import SpecError


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fairtick check",
        description="Prove a tick policy's claims for small bounds by exhaustive search "
                    "(every interleaving of arrivals, aborts, finishes and ticks).",
        epilog=f"Shipped policies: {', '.join(shipped_policy_names())}")
    p.add_argument("specs", nargs="+", metavar="SPEC", help="policy name or YAML path")
    p.add_argument("--layout", choices=("streams", "memory", "both"), default="both",
                   help="streams: decoding may go on forever, KV unlimited; memory: a KV "
                   "budget and a finite max_tokens (default: both)")
    for name, help_text in (("max_seqs", "live sequences at most"),
                            ("max_chunks", "prompt chunks at most"),
                            ("max_running", "sequences holding KV at once")):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                       help=f"{help_text} (streams {getattr(STREAMS, name)}, memory "
                       f"{getattr(MEMORY, name)})")
    p.add_argument("--max-tokens", type=int, default=MEMORY.max_tokens,
                   help=f"memory layout: the largest max_tokens ({MEMORY.max_tokens})")
    p.add_argument("--kv-budget", type=int, default=MEMORY.kv_budget,
                   help=f"memory layout: KV budget in tokens ({MEMORY.kv_budget})")
    p.add_argument("--horizon", type=integer_at_least(1), default=8,
                   help="a wait this long counts as starvation when a claim is unbounded (8)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="override a policy parameter (repeatable)")
    p.add_argument("--lifecycle", metavar="FILE", default=None,
                   help="lifecycle spec (default: specs/lifecycle.yaml)")
    p.add_argument("--time-limit", type=seconds(allow_zero=False), default=None, metavar="S",
                   help="give up (exit 2) if a search takes longer")
    p.add_argument("--stateful", action="store_true",
                   help="also run the Hypothesis stateful test at larger sizes")
    p.add_argument("--examples", type=integer_at_least(1), default=200,
                   help="Hypothesis examples (200)")
    return p


def layouts(args: argparse.Namespace) -> list[CheckLayout]:
    """The layouts `args` asks for."""
    given = {k: v for k, v in (("max_seqs", args.max_seqs), ("max_chunks", args.max_chunks),
                               ("max_running", args.max_running)) if v is not None}
    out = []
    if args.layout in ("streams", "both"):
        out.append(dataclasses.replace(STREAMS, **given))
    if args.layout in ("memory", "both"):
        out.append(dataclasses.replace(MEMORY, **given, max_tokens=args.max_tokens,
                                       kv_budget=args.kv_budget))
    return out


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    args = make_parser().parse_args(argv)
    out = out or sys.stdout
    code = 0
    try:
        overrides = dict(_split(item) for item in args.set)
        lifecycle = load_lifecycle(args.lifecycle)
        policies = [make_policy(spec, overrides) for spec in args.specs]
        plan = [(policy, layout) for policy in policies for layout in layouts(args)]
    except (SpecError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for policy, layout in plan:
        try:
            checker = Checker(policy, layout, lifecycle, args.horizon)
            report = checker.run(args.time_limit)
            print_report(checker, report, out)
        except (CannotCheck, ValueError, TimeoutError, ReplayError) as exc:
            print(f"error: {policy.name}, {layout.name} layout: {exc}", file=sys.stderr)
            return 2
        code = max(code, 0 if report.ok else 1)
    if args.stateful:
        from statemachine.stateful import run_stateful

        for policy in policies:  # each once, whatever the layouts
            result = run_stateful(policy, lifecycle, examples=args.examples)
            silent = [r.name for r in policy.spec.rules if not result.fired[r.name]]
            verdict = f"VIOLATED\n{result.failure}" if result.failure else \
                f"all claims hold ({args.examples} examples)"
            print(f"== {policy.name}: stateful: {verdict}", file=out)
            if silent:
                print(f"   rules that never decided a tick: {', '.join(silent)}", file=out)
            code = max(code, 1 if result.failure else 0)
    return code


def _split(item: str) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    if not sep:
        raise ValueError(f"--set {item!r}: expected NAME=VALUE")
    return name.strip(), value.strip()


def print_report(checker: Checker, report: Report, out: TextIO) -> None:
    """The verdict table, then each counterexample as the Scheduler replayed it."""
    pol, b, a = report.policy, report.bounds, report.abstraction
    params = " ".join(f"{k}={v}" for k, v in pol.params.items())
    print(f"== {pol.name} ({pol.spec.file}) {params}".rstrip(), file=out)
    rate = report.states / report.seconds if report.seconds else 0
    print(f"   {report.layout.name} layout: {report.layout.describe()}", file=out)
    print(f"   {report.states:,} states, {report.edges:,} edges, depth {report.depth}, "
          f"{report.seconds:.1f} s ({rate:,.0f} states/s), peak RSS {report.peak_rss_mb:.0f} MB",
          file=out)
    progress = "tracked" if a.progress else "left open (prompts of any length)"
    print(f"   prefill progress {progress}; chunk sizes {list(a.chunk_sizes)}"
          + (f"; budgets {sorted(set().union(*a.budgets.values()))}" if a.budgets else ""),
          file=out)
    implied = b.implied
    claimed = {"wait_ticks": b.wait_ticks, "overtakes": b.overtakes,
               "decode_wait_ticks": b.decode_wait_ticks, "queue_ticks": b.queue_ticks,
               "preemptions": b.preemptions, "first_grant_ticks": b.first_grant_ticks,
               "ttft_ticks": b.ttft(report.layout.max_chunks)}
    tracked = {"wait_ticks": a.wait_cap, "overtakes": a.overtaken_cap,
               "decode_wait_ticks": a.dwait_cap, "queue_ticks": a.queue_cap,
               "preemptions": a.preemptions_cap}
    rows = [("claim", "bound", "max seen", "verdict")]
    for name in (*CLAIMS, *UNIVERSAL):
        rows.append(_row(name, claimed, tracked, implied, report, pol.spec.claims))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("   " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  "
              + r[3], file=out)
    if report.counterexamples:
        print("   * the search does not expand a state past a violation: these hold in every "
              "state it reached", file=out)
    for name, (_violation, path, chunk) in report.counterexamples.items():
        _print_counterexample(checker, name, path, chunk, out)
    print(file=out)


def _row(name: str, claimed: dict[str, int | None], tracked: dict[str, int],
         implied: dict[str, bool], report: Report,
         declared: Mapping[str, object]) -> tuple[str, str, str, str]:
    bound = claimed.get(name, "-")
    text = "-" if name not in claimed else "unbounded" if bound is None else str(bound)
    if name == "ttft_ticks" and bound is not None:
        text += f" (C={report.layout.max_chunks})"
    seen = str(report.max_seen[name]) if tracked.get(name) and name in report.max_seen \
        else "-"
    if name in report.counterexamples:
        verdict = "VIOLATED"
    elif name in claimed and bound is None:
        verdict = "not claimed" if declared.get(name, 1) is None else \
            "unbounded in this layout (uses max_tokens)" if name not in implied else \
            "unbounded in this layout (follows from unbounded claims)"
    elif name in implied and implied[name]:
        verdict, seen = "holds (follows from the claims above)", "-"
    elif name == "overtakes" and report.abstraction.overtakes_follow:
        verdict, seen = "holds (follows from round_robin, one grant a tick)", "-"
    elif name == "no_starvation" and claimed["wait_ticks"] is not None:
        verdict = "holds (wait_ticks is bounded)"
    else:
        verdict = "holds*" if report.counterexamples else "holds"
    return name, text, seen, verdict


def _print_counterexample(checker: Checker, name: str, path: list[Label], chunk: int,
                          out: TextIO) -> None:
    run = replay(checker, path, chunk)
    first = run.violations[0]
    print(f"\n-- counterexample for {name} (chunk size {chunk}), as the Scheduler ran it: "
          f"{first.name}: {first.message}", file=out)
    for extra in run.violations[1:]:
        print(f"   also {extra.name}: {extra.message}", file=out)
    print(f"   shortest path: {len(run.steps)} steps", file=out)
    for n, text in enumerate(run.steps, 1):
        print(f"   {n:>3}. {text}", file=out)
    if run.lasso:
        i, j = run.lasso
        print(f"   everything the policy sees is the same after step {i} and after step "
              f"{j}, with no grant to seq {first.seq} between: steps {i + 1}..{j} can repeat "
              "forever, and it waits forever", file=out)
    print("\n   trace:\n" + _indent(format_table(run.events)), file=out)
    print("\n   trace (JSON lines):\n" + _indent(to_jsonl(run.events).rstrip()), file=out)


def _indent(text: str) -> str:
    return "\n".join("   " + line for line in text.splitlines())
