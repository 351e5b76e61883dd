"""`fairtick check SPEC...`: run the exhaustive checker (and optionally the Hypothesis stateful
test) on policy specs and print a verdict per claim. Exit 0: all hold; 1: a violation (the
shortest counterexample is printed); 2: a spec or argument error."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from statemachine.checker import CLAIM_ORDER, Checker, Report
from statemachine.spec import shipped_policy_names
from statemachine.tick import make_policy
from statemachine.trace import format_table, to_jsonl
from statemachine.yamlsrc import SpecError


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fairtick check",
        description="Prove a tick policy's claims for small bounds by exhaustive search "
                    "(every interleaving of arrivals, aborts, decode completions and ticks).",
        epilog=f"Shipped policies: {', '.join(shipped_policy_names())}")
    p.add_argument("specs", nargs="+", metavar="SPEC", help="policy name or YAML path")
    # 3/3/3 keeps every shipped default under half a minute; the larger benchmark layout is
    # --max-seqs 4 --max-chunks 4 --slots 4 (see docs/benchmark_results/).
    p.add_argument("--max-seqs", type=int, default=3, help="live sequences at most (3)")
    p.add_argument("--max-chunks", type=int, default=3, help="prompt chunks at most (3)")
    p.add_argument("--slots", type=int, default=3, help="slots (--parallel) (3)")
    p.add_argument("--horizon", type=int, default=8,
                   help="a wait this long counts as starvation when a claim is unbounded (8)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="override a policy parameter (repeatable)")
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="give up (exit 2) if the search takes longer")
    p.add_argument("--stateful", action="store_true",
                   help="also run the Hypothesis stateful test at larger sizes")
    p.add_argument("--stateful-slots", type=int, default=12)
    p.add_argument("--stateful-chunks", type=int, default=20)
    p.add_argument("--examples", type=int, default=200, help="Hypothesis examples (200)")
    return p


def main(argv: list[str] | None = None, out: TextIO = sys.stdout) -> int:
    args = make_parser().parse_args(argv)
    code = 0
    for spec in args.specs:
        try:
            overrides = dict(_split(item) for item in args.set)
            policy = make_policy(spec, overrides)
            checker = Checker(policy, args.max_seqs, args.max_chunks, args.slots, args.horizon)
            report = checker.run(args.time_limit)
        except (SpecError, ValueError, TimeoutError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print_report(checker, report, out)
        code = max(code, 0 if report.ok else 1)
        if args.stateful:
            from statemachine.stateful import run_stateful

            failure = run_stateful(policy, args.stateful_slots, args.stateful_chunks,
                                   args.examples)
            if failure:
                print(f"  stateful: VIOLATED\n{failure}", file=out)
                code = 1
            else:
                print(f"  stateful ({args.examples} examples, {args.stateful_slots} slots, up "
                      f"to {args.stateful_chunks} chunks): all claims hold", file=out)
    return code


def _split(item: str) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    if not sep:
        raise ValueError(f"--set {item!r}: expected NAME=VALUE")
    return name.strip(), value.strip()


def print_report(checker: Checker, report: Report, out: TextIO) -> None:
    """The verdict table, then a counterexample for each violation."""
    pol = report.policy
    params = " ".join(f"{k}={v}" for k, v in pol.params.items())
    print(f"== {pol.name} ({pol.spec.file}) {params}".rstrip(), file=out)
    print(f"   {report.max_seqs} sequences, 1..{report.max_chunks} chunks, {report.slots} "
          f"slots: {report.states:,} states, {report.edges:,} edges, depth {report.depth}, "
          f"{report.seconds:.1f} s", file=out)
    b = report.bounds
    claimed = {"wait_ticks": b.wait_ticks, "overtakes": b.overtakes,
               "decode_wait_ticks": b.decode_wait_ticks,
               "ttft_ticks": b.ttft(report.max_chunks)}
    rows = [("claim", "bound", "max seen", "verdict")]
    for name in CLAIM_ORDER:
        bound = claimed.get(name, "-")
        text = "unbounded" if bound is None else str(bound)
        if name == "ttft_ticks" and bound is not None:
            text += f" (C={report.max_chunks})"
        seen = str(report.max_seen.get(name, "-"))
        if name in report.counterexamples:
            verdict = "VIOLATED"
        elif bound is None:
            verdict = "not claimed"
        elif name == "ttft_ticks" and checker.ttft_implied:
            verdict, seen = "holds (follows from wait_ticks)", "-"
        else:
            verdict = "holds"
        rows.append((name, text, seen, verdict))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("   " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  "
              + r[3], file=out)
    for name, (violation, path) in report.counterexamples.items():
        print(f"\n-- counterexample for {name}: {violation.message}", file=out)
        print(f"   shortest path: {len(path)} steps", file=out)
        steps = checker.replay(path)
        for n, (text, _) in enumerate(steps, 1):
            print(f"   {n:>3}. {text}", file=out)
        loop = checker.lasso(path, violation.seq) if name == "no_starvation" and \
            violation.seq is not None else None
        if loop:
            print(f"   the lifecycle states after step {loop[0]} recur after step {loop[1]} "
                  f"without a grant to seq {violation.seq}: repeating steps {loop[0] + 1}.."
                  f"{loop[1]} forever, it waits forever", file=out)
        events = [e for _, evs in steps for e in evs]
        print("\n   trace:\n" + _indent(format_table(events)), file=out)
        print("\n   trace (JSON lines):\n" + _indent(to_jsonl(events).rstrip()), file=out)
    print(file=out)


def _indent(text: str) -> str:
    return "\n".join("   " + line for line in text.splitlines())
