#!/usr/bin/env python3
"""Memory pressure loses nothing: greedy requests through a KV budget too small for them all.

Starts `fairtick serve` twice (on 127.0.0.1, free ports, default flags otherwise): once with the
KV budget sized from memory ("unconstrained"), once with `--max-kv-tokens N`. Each time it sends
the same requests at once (greedy completions, max_tokens summing to more than N) and records
their texts. Then, on the constrained server, it sends more requests than `--max-waiting` lets
queue and counts the 429s and their Retry-After. Prints, for each request, whether its text is
the unconstrained run's, its tokens and its preemptions; the preemptions in /metrics by kind;
the preempt and resume events in /debug/trace; and writes OUT/memory-pressure.json.

Exit 0 when every request completed with the unconstrained text, at least one preemption
happened, and the requests past the waiting limit got 429 with Retry-After; 2 otherwise.

    .venv/bin/python scripts/bench_memory_pressure.py                    # 8000 tokens, 8 requests
    .venv/bin/python scripts/bench_memory_pressure.py --kv-full pause    # keep KV, pause instead
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml
from benchlib.attribution import REPO
from benchlib.client import exchange, get_json, get_metrics, get_trace, wait_idle
from benchlib.serve import Server, start_server, stop_server

from statemachine.lifecycle import Trigger
from statemachine.spec import DEFAULT_POLICY

PREEMPT, PAUSE, RESUME, READMIT = (Trigger.PREEMPT.value, Trigger.PAUSE.value,
                                   Trigger.RESUME.value, Trigger.READMIT.value)

DEFAULT_TOKENS = "2000,3000,4000,5000,6000,6000,7000,7000"  # 40,000 in all


@dataclass
class Completion:
    """One request's outcome."""

    index: int
    max_tokens: int
    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    seconds: float = 0.0


@dataclass
class Run:
    label: str
    flags: list[str]
    kv_budget_tokens: float
    completions: list[Completion]
    seconds: float
    preemptions: dict[str, float] = field(default_factory=dict)
    trace_events: dict[str, int] = field(default_factory=dict)
    max_preemptions_of_one: int = 0


def prompt_of(i: int) -> str:
    return f"Request {i}: the story of a sequence that waited for its KV, part {i}. "


def complete(url: str, c: Completion, timeout_s: float) -> None:
    body = {"prompt": prompt_of(c.index), "max_tokens": c.max_tokens, "temperature": 0}
    started = time.monotonic()
    try:
        reply = exchange(url, "POST", "/v1/completions", body, timeout_s=timeout_s)
        if reply.status != 200:
            c.error = f"HTTP {reply.status}: {reply.body[:300]!r}"
            return
        answer = reply.json()
        c.text = answer["choices"][0]["text"]
        c.finish_reason = answer["choices"][0]["finish_reason"]
        c.tokens = answer["usage"]["completion_tokens"]
    except (OSError, ValueError, KeyError) as exc:
        c.error = f"{type(exc).__name__}: {exc}"
    finally:
        c.seconds = time.monotonic() - started


def send_all(url: str, max_tokens: list[int], timeout_s: float) -> list[Completion]:
    """Every request at once, each on its own thread; their outcomes in order."""
    out = [Completion(i, n) for i, n in enumerate(max_tokens)]
    threads = [threading.Thread(target=complete, args=(url, c, timeout_s)) for c in out]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def measure(label: str, flags: list[str], max_tokens: list[int], out: Path, timeout_s: float,
            then: Callable[[Server], dict[str, Any]] | None = None) -> tuple[Run, dict[str, Any]]:
    """Serve with `flags`, send the requests, read back preemptions; `then(server)`, if given,
    runs on the same server before it stops (its result is returned beside the run)."""
    server = start_server(flags, out / f"serve-{label}.log")
    try:
        budget = get_metrics(server.url).get("fairtick_kv_budget_tokens", float("nan"))
        tick = int(get_json(server.url, "/debug/state")["tick"])
        started = time.monotonic()
        completions = send_all(server.url, max_tokens, timeout_s)
        run = Run(label, flags, budget, completions, time.monotonic() - started)
        metrics = get_metrics(server.url)
        run.preemptions = {k: v for k, v in metrics.items()
                           if k.startswith("fairtick_preemptions_total")}
        events = get_trace(server.url, tick)
        run.trace_events = dict(Counter(e["trigger"] for e in events
                                        if e["trigger"] in (PREEMPT, PAUSE, RESUME, READMIT)))
        per_seq = Counter(e["seq"] for e in events if e["trigger"] in (PREEMPT, PAUSE))
        run.max_preemptions_of_one = max(per_seq.values(), default=0)
        return run, then(server) if then is not None else {}
    finally:
        stop_server(server)


def overflow(server: Server, budget: int, max_waiting: int, timeout_s: float) -> dict[str, Any]:
    """At once: as many prompts (1000 tokens, or an eighth of the budget if less) as the KV
    budget holds by their prompts alone (the most the scheduler runs at once: it accounts KV
    as it is used), max_waiting more to fill the queue, and 4 beyond: how many got 429, and
    whether each 429 said when to come back. Each asks for as many tokens as the budget leaves
    it, up to 256, so none finishes (and frees its place) before the last is sent: with 64, a
    fast engine finished the first while the burst was still arriving and nothing was
    refused; counting only the prompts that fit with their whole output, a fast engine
    admitted enough of the burst while it arrived that the queue never filled."""
    prompt_tokens = max(16, min(1000, budget // 8))
    max_tokens = max(16, min(256, budget - prompt_tokens))
    count = budget // prompt_tokens + max_waiting + 4
    replies: list[tuple[int, str | None]] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        prompt = (prompt_of(100 + i) * 20)[:prompt_tokens - 1]  # one token a byte, and BOS
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        try:
            r = exchange(server.url, "POST", "/v1/completions", body, timeout_s=timeout_s)
            with lock:
                replies.append((r.status, r.headers.get("retry-after")))
        except OSError as exc:
            with lock:
                replies.append((-1, str(exc)))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = Counter(s for s, _ in replies)
    busy = [h for s, h in replies if s == 429]
    return {"sent": count, "statuses": dict(statuses), "429_with_retry_after":
            sum(1 for h in busy if h and h.isdigit()), "retry_after_values": sorted(set(busy))}


def policy_with(kv_full: str, out: Path, policy: str) -> Path:
    """A copy of a shipped policy whose kv_full is `kv_full`."""
    doc = yaml.safe_load((REPO / "specs" / "policies" / f"{policy}.yaml").read_text())
    doc["name"] = f"{doc['name']}_{kv_full}"
    doc["kv_full"] = kv_full
    path = out / f"{doc['name']}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def report(free: Run, tight: Run, busy: dict[str, Any]) -> tuple[str, bool]:
    lines = ["| request | max_tokens | tokens | same text as unconstrained | seconds "
             "(unconstrained / budget) | error |", "|---:|---:|---:|---|---|---|"]
    same_all = True
    for a, b in zip(free.completions, tight.completions, strict=True):
        same = a.error is None and b.error is None and a.text == b.text and \
            b.tokens == b.max_tokens
        same_all &= same
        lines.append(f"| {b.index} | {b.max_tokens} | {b.tokens} | {'yes' if same else 'NO'} | "
                     f"{a.seconds:.0f} / {b.seconds:.0f} | {b.error or a.error or ''} |")
    preempted = sum(tight.preemptions.values())
    kinds = {k.partition('kind="')[2].rstrip('"}'): v for k, v in tight.preemptions.items()}
    lines += ["", f"- unconstrained: KV budget {free.kv_budget_tokens:.0f} tokens, "
              f"{free.seconds:.0f} s, preemptions {sum(free.preemptions.values()):.0f}",
              f"- with the budget: KV budget {tight.kv_budget_tokens:.0f} tokens, "
              f"{tight.seconds:.0f} s, preemptions in /metrics "
              f"{kinds}, "
              f"in /debug/trace {tight.trace_events}, at most "
              f"{tight.max_preemptions_of_one} for one request",
              f"- past the waiting limit: sent {busy['sent']}, statuses {busy['statuses']}, "
              f"429s with Retry-After {busy['429_with_retry_after']} "
              f"(values {busy['retry_after_values']})"]
    ok = (same_all and preempted > 0 and busy["statuses"].get(429, 0) > 0
          and busy["429_with_retry_after"] == busy["statuses"].get(429, 0)
          and all(s in (200, 429) for s in busy["statuses"]))
    lines.append(f"- verdict: {'nothing lost' if ok else 'FAILED'}")
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-kv-tokens", type=int, default=8000, metavar="N",
                   help="the tight KV budget (8000)")
    p.add_argument("--max-tokens", default=DEFAULT_TOKENS, metavar="N,N,...",
                   help=f"max_tokens of each request ({DEFAULT_TOKENS})")
    p.add_argument("--max-waiting", type=int, default=None, metavar="N",
                   help="--max-waiting of the constrained server, at least the number of "
                   "requests (default: that number)")
    p.add_argument("--kv-full", choices=("recompute", "pause"), default=None,
                   help="run a copy of the policy with this kv_full (default: the policy's own)")
    p.add_argument("--policy", default=DEFAULT_POLICY,
                   help=f"the shipped policy ({DEFAULT_POLICY}, the default)")
    p.add_argument("--serve-flags", default="", metavar="'FLAGS'",
                   help="more `fairtick serve` flags for both servers")
    p.add_argument("--timeout-s", type=float, default=3600, metavar="S",
                   help="bound on each request (3600)")
    p.add_argument("--out", type=Path, default=Path("bench-out"), metavar="DIR")
    args = p.parse_args(argv)
    try:
        max_tokens = [int(x) for x in args.max_tokens.split(",")]
    except ValueError:
        p.error(f"--max-tokens must be comma-separated integers, got {args.max_tokens!r}")
    if not max_tokens or min(max_tokens) < 1:
        p.error("--max-tokens needs at least one positive count")
    if args.max_waiting is None:
        args.max_waiting = len(max_tokens)
    if args.max_waiting < len(max_tokens):
        p.error(f"--max-waiting {args.max_waiting} would turn the measured requests away: it "
                f"must be at least their number, {len(max_tokens)}")
    args.out.mkdir(parents=True, exist_ok=True)
    policy = str(policy_with(args.kv_full, args.out, args.policy)) if args.kv_full \
        else args.policy
    base = ["--policy", policy, *shlex.split(args.serve_flags)]
    print(f"{len(max_tokens)} requests, max_tokens {max_tokens} (sum {sum(max_tokens)}), "
          f"budget {args.max_kv_tokens}, policy {policy}", file=sys.stderr, flush=True)
    free, _ = measure("unconstrained", base, max_tokens, args.out, args.timeout_s)
    print(f"unconstrained: {free.seconds:.0f} s", file=sys.stderr, flush=True)
    tight_flags = [*base, "--max-kv-tokens", str(args.max_kv_tokens),
                   "--max-waiting", str(args.max_waiting)]

    def past_the_limit(server: Server) -> dict[str, Any]:
        wait_idle(server.url)
        return overflow(server, args.max_kv_tokens, args.max_waiting, args.timeout_s)

    tight, busy = measure("budget", tight_flags, max_tokens, args.out, args.timeout_s,
                          then=past_the_limit)
    text, ok = report(free, tight, busy)
    print(text)
    (args.out / "memory-pressure.json").write_text(json.dumps(
        {"unconstrained": asdict(free), "budget": asdict(tight), "past_waiting_limit": busy,
         "nothing_lost": ok}, indent=1))
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
