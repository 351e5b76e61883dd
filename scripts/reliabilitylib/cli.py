"""The command line of scripts/reliability.py: find the server, run the chosen phases, print
their tables and exit 0 (all passed), 1 (a phase failed) or 2 (no usable server)."""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import sys
from collections.abc import Callable

from benchlib.client import ServerError

from reliabilitylib.fuzz import run_bodies, run_fuzz
from reliabilitylib.phases import run_load, run_overload, run_storm
from reliabilitylib.report import PhaseResult, write_json
from reliabilitylib.target import Target

PHASES: dict[str, Callable[[Target, argparse.Namespace], PhaseResult]] = {
    "load": run_load, "storm": run_storm, "fuzz": run_fuzz, "bodies": run_bodies,
    "overload": run_overload}


def discover(args: argparse.Namespace) -> Target:
    """The server at --url, its model, running limit, queue and chunk size read from it."""
    probe = Target(args.url, "", 0, 0, 0, 0, args.pid, args.timeout_s)
    card = probe.get_json("/v1/models")["data"][0]
    state = probe.get_json("/debug/state")
    max_waiting = state.get("admission", {}).get("max_waiting", args.max_waiting)
    if max_waiting is None:
        raise ValueError("the server does not report its waiting queue: give --max-waiting")
    return dataclasses.replace(
        probe, model=card["id"], context_length=int(card["max_model_len"]),
        max_running=int(state["max_running"]), max_waiting=int(max_waiting),
        chunk_size=int(state["prefill_chunk_size"]))


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--pid", type=int, default=None,
                   help="the server's process id, to read its RSS from /proc (same machine)")
    p.add_argument("--phases", default="load,storm,fuzz,bodies,overload")
    p.add_argument("--max-waiting", type=int, default=None,
                   help="the server's --max-waiting, if /debug/state does not report it")
    p.add_argument("--load-streams", type=int, default=64)
    p.add_argument("--load-tokens", type=int, default=64)
    p.add_argument("--load-concurrency", type=int, default=0, help="0: min(max_waiting, 32)")
    p.add_argument("--storm-streams", type=int, default=300)
    p.add_argument("--storm-tokens", type=int, default=64)
    p.add_argument("--storm-concurrency", type=int, default=0, help="0: max_waiting")
    p.add_argument("--rss-limit-mib", type=float, default=64.0,
                   help="largest RSS growth over the storm that passes")
    p.add_argument("--fuzz-examples", type=int, default=300)
    p.add_argument("--fuzz-bodies", type=int, default=1000,
                   help="bodies the `bodies` phase sends: documented shapes, wrong values")
    p.add_argument("--overload-requests", type=int, default=0,
                   help="0: 4 x (max_running + max_waiting)")
    p.add_argument("--overload-tokens", type=int, default=8)
    p.add_argument("--timeout-s", type=float, default=120.0,
                   help="per request: a request not answered within it is a hang")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="also write the tables as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None, description: str = "") -> int:
    """Run the phases named by --phases; the exit status."""
    args = parse_args(argv, description)
    names = [n.strip() for n in args.phases.split(",") if n.strip()]
    unknown = [n for n in names if n not in PHASES]
    if unknown:
        print(f"reliability: unknown phase(s) {unknown}; choose from {list(PHASES)}",
              file=sys.stderr)
        return 2
    try:
        t = discover(args)
    except (OSError, http.client.HTTPException, ServerError, ValueError, KeyError) as exc:
        print(f"reliability: cannot use the server at {args.url}: {exc}", file=sys.stderr)
        return 2
    print(f"# fairtick reliability: {args.url} ({t.model}, {t.max_running} running, max_waiting "
          f"{t.max_waiting}, chunk {t.chunk_size}, context {t.context_length})")
    results = []
    for name in names:
        try:
            result = PHASES[name](t, args)
        except (OSError, http.client.HTTPException, RuntimeError) as exc:
            result = PhaseResult(name, [("error", repr(exc))], [f"phase crashed: {exc!r}"])
        result.print()
        results.append(result)
    if args.json_out:
        write_json(results, args.json_out)
    failed = [r.name for r in results if r.failures]
    print(f"\n{'FAILED: ' + ', '.join(failed) if failed else 'all phases passed'}")
    return 1 if failed else 0
