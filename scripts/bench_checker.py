"""How long `fairtick check` takes on every shipped policy at its defaults, in each layout.

    .venv/bin/python scripts/bench_checker.py [--layout streams|memory|both] [POLICY ...]

Each policy and layout runs in a fresh process (so peak memory is that check's own) and prints
one row: states, edges, seconds, states/s, peak RSS and the verdict.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

ONE = """
import json, sys
from statemachine.checker import MEMORY, STREAMS, Checker
from statemachine.tick import make_policy
name, layout = sys.argv[1], {"streams": STREAMS, "memory": MEMORY}[sys.argv[2]]
report = Checker(make_policy(name), layout).run()
print(json.dumps({"states": report.states, "edges": report.edges,
                  "seconds": report.seconds, "rss_mb": report.peak_rss_mb,
                  "violated": sorted(report.counterexamples)}))
"""


def main() -> int:
    from statemachine.spec import shipped_policy_names

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("policies", nargs="*", default=shipped_policy_names())
    p.add_argument("--layout", choices=("streams", "memory", "both"), default="both")
    args = p.parse_args()
    layouts = ["streams", "memory"] if args.layout == "both" else [args.layout]
    print("| policy | layout | states | edges | seconds | states/s | peak RSS MB | verdict |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.policies:
        for layout in layouts:
            out = subprocess.run([sys.executable, "-c", ONE, name, layout], check=True,
                                 capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            verdict = "violated: " + ", ".join(r["violated"]) if r["violated"] else "holds"
            print(f"| {name} | {layout} | {r['states']:,} | {r['edges']:,} | "
                  f"{r['seconds']:.1f} | {r['states'] / r['seconds']:,.0f} | "
                  f"{r['rss_mb']:.0f} | {verdict} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
