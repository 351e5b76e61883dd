"""fairtick's router against Ray Serve's default router (power of two choices), on one mixed
workload, alternated in one run: `fairtick cluster` with 2 replicas on this machine, many
short requests plus an occasional long prompt, all streamed.

    python scripts/bench_cluster_routing.py --rounds 2

Each arm deploys fresh replicas (same engine flags: the defaults, --max-kv-tokens for each
replica) and replays the same seeded schedule: a short request (`--short-tokens` prompt tokens,
`--short-max-tokens` streamed) every `--short-every-s` (+-30% jitter) for `--duration-s`, and a
long prompt (`--long-tokens`, `--long-max-tokens` streamed) every `--long-every-s` from
`--long-first-s`. Prints the TTFT p50 / p95 / p99 / worst of the short requests and of the long
prompts per router (pooled over rounds), their ratios, the requests each replica served, and
the load average (on a 2-core machine the replicas share the cores).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import string
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import numpy as np  # noqa: E402
from benchlib.client import TimedStream, exchange  # noqa: E402

ROUTERS = ("fairtick", "power-of-two")


@dataclass(frozen=True)
class Arrival:
    """One request of the schedule: when (seconds from the start), its kind and prompt."""

    at_s: float
    kind: str  # "short" or "long"
    prompt: str
    max_tokens: int


@dataclass
class ArmResult:
    """The TTFTs (seconds) of one router's requests, by kind, and where they went."""

    router: str
    ttft_s: dict[str, list[float]] = field(default_factory=lambda: {"short": [], "long": []})
    errors: list[str] = field(default_factory=list)
    served_by: Counter[str] = field(default_factory=Counter)


def make_schedule(args: argparse.Namespace) -> list[Arrival]:
    """The seeded workload both routers replay."""
    rng = random.Random(args.seed)

    def text(tokens: int) -> str:  # the built-in model's tokenizer: one token a character
        return "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(tokens))

    arrivals, t = [], 0.0
    while t < args.duration_s:
        arrivals.append(Arrival(t, "short", text(args.short_tokens), args.short_max_tokens))
        t += args.short_every_s * rng.uniform(0.7, 1.3)
    t = args.long_first_s
    while t < args.duration_s:
        arrivals.append(Arrival(t, "long", text(args.long_tokens), args.long_max_tokens))
        t += args.long_every_s
    return sorted(arrivals, key=lambda a: a.at_s)


def run_arm(url: str, router: str, schedule: list[Arrival], timeout_s: float) -> ArmResult:
    """Replay the schedule against the endpoint; wait for every request to end."""
    result = ArmResult(router)
    started = time.monotonic()
    streams: list[tuple[Arrival, TimedStream]] = []
    for arrival in schedule:
        time.sleep(max(0.0, started + arrival.at_s - time.monotonic()))
        streams.append((arrival, TimedStream(url, arrival.prompt, arrival.max_tokens,
                                             timeout_s).start()))
    for arrival, stream in streams:
        stream.join(max(1.0, started + timeout_s - time.monotonic()))
        if stream.error is not None or stream.ttft_s is None:
            result.errors.append(f"{arrival.kind} at {arrival.at_s:.1f} s: {stream.error}")
        else:
            result.ttft_s[arrival.kind].append(stream.ttft_s)
    return result


def served_by_replica(url: str) -> Counter[str]:
    """Requests each replica finished so far (/metrics, labelled by replica)."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: Counter[str] = Counter()
    text = exchange(url, "GET", "/metrics").body.decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "fairtick_requests_finished_total":
                counts[s.labels["replica"]] += int(s.value)
    return counts


def summary(values: list[float]) -> dict[str, float]:
    """p50 / p95 / p99 / worst (seconds)."""
    if not values:
        return {}
    p50, p95, p99 = np.percentile(values, [50, 95, 99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99), "worst": max(values)}


def print_report(results: list[ArmResult]) -> dict[str, object]:
    """The side-by-side table; returns it as JSON-able data."""
    pooled = {r: {k: [t for a in results if a.router == r for t in a.ttft_s[k]]
                  for k in ("short", "long")} for r in ROUTERS}
    table = {r: {k: {"n": len(v), **summary(v)} for k, v in pooled[r].items()} for r in ROUTERS}
    print("\n| router | kind | n | TTFT p50 | p95 | p99 | worst |")
    print("|---|---|---|---|---|---|---|")
    for r in ROUTERS:
        for k in ("short", "long"):
            s = table[r][k]
            cells = " | ".join(f"{s[q]:.3f} s" if q in s else "-"
                               for q in ("p50", "p95", "p99", "worst"))
            print(f"| {r} | {k} | {s['n']} | {cells} |")
    for k in ("short", "long"):
        a, b = table["fairtick"][k], table["power-of-two"][k]
        if "p50" in a and "p50" in b:
            print(f"- {k}: power-of-two / fairtick TTFT at p50 {b['p50'] / a['p50']:.2f}x, "
                  f"at p95 {b['p95'] / a['p95']:.2f}x")
    for arm in results:
        print(f"- {arm.router}: served by replica {dict(arm.served_by)}; "
              f"{len(arm.errors)} errors {arm.errors[:3]}")
    return {"table": table, "arms": [{"router": a.router, "ttft_s": a.ttft_s,
                                      "errors": a.errors, "served_by": dict(a.served_by)}
                                     for a in results]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="each router this many times")
    p.add_argument("--duration-s", type=float, default=60.0)
    p.add_argument("--short-every-s", type=float, default=0.5)
    p.add_argument("--short-tokens", type=int, default=40)
    p.add_argument("--short-max-tokens", type=int, default=16)
    p.add_argument("--long-tokens", type=int, default=3000)
    p.add_argument("--long-max-tokens", type=int, default=4)
    p.add_argument("--long-first-s", type=float, default=5.0)
    p.add_argument("--long-every-s", type=float, default=20.0)
    p.add_argument("--max-kv-tokens", type=int, default=60_000, help="each replica's budget")
    p.add_argument("--num-cpus", type=int, default=os.cpu_count() or 2)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=18200)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from ray import serve

    import runtime  # noqa: F401 - the BLAS under MLX, as `fairtick serve` loads it
    from cluster.deploy import APP_NAME, ClusterSpec, deploy, init_ray, stop_cluster
    from runtime.engine import EngineConfig
    from server.config import ServerConfig

    print(f"load average at start: {os.getloadavg()}; {os.cpu_count()} cores")
    config = ServerConfig(engine=EngineConfig(max_kv_tokens=args.max_kv_tokens),
                          port=args.port, stop_grace_s=0.0, log_level="warning")
    schedule = make_schedule(args)
    print(f"schedule: {sum(a.kind == 'short' for a in schedule)} short, "
          f"{sum(a.kind == 'long' for a in schedule)} long over {args.duration_s:g} s")
    init_ray(ClusterSpec(num_cpus=args.num_cpus))
    results = []
    try:
        for round_index in range(args.rounds):
            order = ROUTERS if round_index % 2 == 0 else ROUTERS[::-1]
            for router in order:
                url = deploy(config, ClusterSpec(replicas=args.replicas, router=router,
                                                 num_cpus=args.num_cpus))
                exchange(url, "POST", "/v1/completions", {"prompt": "warm", "max_tokens": 2})
                before = served_by_replica(url)
                arm = run_arm(url, router, schedule, args.timeout_s)
                arm.served_by = served_by_replica(url) - before
                results.append(arm)
                print(f"round {round_index} {router}: short p50 "
                      f"{summary(arm.ttft_s['short']).get('p50', float('nan')):.3f} s, long "
                      f"p50 {summary(arm.ttft_s['long']).get('p50', float('nan')):.3f} s; "
                      f"load average {os.getloadavg()}", flush=True)
                serve.delete(APP_NAME)
    finally:
        stop_cluster()
    report = print_report(results)
    print(f"load average at the end: {os.getloadavg()}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
