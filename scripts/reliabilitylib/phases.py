"""The load, disconnect-storm and overload phases: each runs against a Target and returns a
PhaseResult (the fuzz phase is in `fuzz`)."""

from __future__ import annotations

import argparse
import http.client
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchlib.client import get_trace

from reliabilitylib.report import PhaseResult
from reliabilitylib.streams import Reference, problems, reference, stream
from reliabilitylib.target import (
    Target,
    failure_kind,
    health_ok,
    is_json_error,
    retry_after_s,
    rss_bytes,
    settled_rss,
    wait_drained,
)


def prompts(t: Target, count: int) -> list[str]:
    """Short prompts and some spanning several prefill chunks (so some sequences park)."""
    long_len = min(int(t.chunk_size * 2.5), t.context_length // 4)
    return [f"p{i}: the tick scheduler " + ("x" * long_len if i % 4 == 3 else "")
            for i in range(count)]


def run_load(t: Target, args: argparse.Namespace) -> PhaseResult:
    """Concurrent streams, each of which must equal its prompt's reference exactly."""
    tokens, n = args.load_tokens, args.load_streams
    refs = [reference(t, p, tokens) for p in prompts(t, 8)]
    concurrency = args.load_concurrency or min(t.max_waiting, 32)
    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(lambda i: stream(t, refs[i % len(refs)].prompt, tokens), range(n)))
    wall = time.monotonic() - started
    found = [problems(o, refs[i % len(refs)], tokens) for i, o in enumerate(outs)]
    received = sum(len(o.pieces) for o in outs)
    lost = sum(max(0, tokens - len(o.pieces)) for o in outs)
    dup = sum(max(0, len(o.pieces) - tokens) for o in outs)
    kinds = Counter(p for f in found for p in f)
    exact = sum(1 for f in found if not f)
    rows = [("streams x max_tokens", f"{n} x {tokens}"), ("concurrent clients", concurrency),
            ("streams exact", f"{exact}/{n}"), ("tokens expected", n * tokens),
            ("tokens received", received), ("lost", lost), ("duplicated", dup),
            ("text differs from reference", kinds["text differs"]),
            ("usage disagrees", kinds["usage"]), ("429 retries", sum(o.retries for o in outs)),
            ("other problems", dict(kinds - Counter({"text differs": kinds["text differs"],
                                                     "usage": kinds["usage"]})) or "none"),
            ("wall", f"{wall:.1f} s ({received / wall:.0f} tokens/s)")]
    failures = [f"{n - exact} streams not exact: {dict(kinds)}"] if exact != n else []
    return PhaseResult("load", rows, failures)


def storm_plan(rng: random.Random, n: int, num_refs: int, tokens: int) -> list[tuple[int, Any]]:
    """(reference index, cut) per stream. About half are cut: a third of those up to 2 s after
    sending, reading nothing (waiting, parked or prefilling), the rest after k tokens
    (decoding)."""
    return [(i % num_refs, None if rng.random() < 0.5 else -rng.uniform(0.001, 2.0)
             if rng.random() < 1 / 3 else rng.randrange(tokens)) for i in range(n)]


def rss_rows(start: int | None, end: int | None,
             limit_mib: float) -> tuple[list[tuple[str, Any]], list[str]]:
    """The RSS row of the storm's table, and its failure if the RSS grew past the limit."""
    if start is None or end is None:
        return [("server RSS", "not measurable (give --pid of the server on this machine)")], []
    grow = (end - start) / 2**20
    row = ("server RSS start -> end", f"{start / 2**20:.1f} -> {end / 2**20:.1f} MiB "
           f"({grow:+.1f} MiB; limit +{limit_mib})")
    return [row], ([f"RSS grew {grow:.1f} MiB"] if grow > limit_mib else [])


def run_storm(t: Target, args: argparse.Namespace) -> PhaseResult:
    """Streams cut at random points; afterwards the server holds nothing, its RSS is back near
    its start and a normal request is what it was before."""
    tokens, n, rng = args.storm_tokens, args.storm_streams, random.Random(args.seed)
    normal = reference(t, "the normal request", 32)
    refs = [reference(t, p, tokens) for p in prompts(t, 8)]
    wait_drained(t, 30)
    rss_start = rss_bytes(t.pid)
    plan = storm_plan(rng, n, len(refs), tokens)
    first_tick = t.get_json("/debug/state").get("tick", 0)
    concurrency = args.storm_concurrency or t.max_waiting
    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(lambda p: stream(t, refs[p[0]].prompt, tokens, p[1]), plan))
    wall = time.monotonic() - started
    left = wait_drained(t, 60)
    rss_end = settled_rss(t.pid, rss_start, args.rss_limit_mib)
    after = reference(t, normal.prompt, 32)
    uncut = [(o, refs[p[0]]) for o, p in zip(outs, plan, strict=True) if p[1] is None]
    bad_uncut = Counter(x for o, ref in uncut for x in problems(o, ref, tokens))
    cut = [o for o, p in zip(outs, plan, strict=True) if p[1] is not None]
    bad_cut = Counter(o.failure or f"HTTP {o.status}" for o in cut
                      if o.failure or (o.status is not None and o.status >= 500))
    exact_uncut = sum(1 for o, ref in uncut if not problems(o, ref, tokens))
    cut_states = Counter("before the answer" if p[1] < 0 else "after k tokens"
                         for p in plan if p[1] is not None)
    aborted_from = Counter(e["from"] for e in get_trace(t.url, first_tick)
                           if e["trigger"] == "abort")
    rows = [("streams x max_tokens", f"{n} x {tokens}"), ("concurrent clients", concurrency),
            ("cut", f"{len(cut)} ({dict(cut_states)})"),
            ("aborts by lifecycle state (trace)", dict(aborted_from.most_common()) or "none"),
            ("uncut streams exact", f"{exact_uncut}/{len(uncut)}"),
            ("uncut problems", dict(bad_uncut) or "none"),
            ("cut streams: 5xx/reset/hang before the cut", dict(bad_cut) or "none"),
            ("429 retries", sum(o.retries for o in outs)), ("wall", f"{wall:.1f} s")]
    rows += [(f"after: {name}", value) for name, value in left.items()]
    more_rows, failures = rss_rows(rss_start, rss_end, args.rss_limit_mib)
    rows += more_rows
    exact_after = after.text == normal.text and after.prompt_tokens == normal.prompt_tokens
    rows.append(("normal request after the storm", "exact" if exact_after else "DIFFERS"))
    if exact_uncut != len(uncut):
        failures.append(f"{len(uncut) - exact_uncut} uncut streams not exact")
    if bad_cut:
        failures.append(f"cut streams failed before their cut: {dict(bad_cut)}")
    if any(left.values()):
        failures.append(f"not drained: {left}")
    if not exact_after:
        failures.append("the normal request differs after the storm")
    return PhaseResult("disconnect storm", rows, failures)


def overload_one(t: Target, ref: Reference, max_tokens: int,
                 barrier: threading.Barrier) -> tuple[str, float]:
    """One simultaneous request of the overload phase: its outcome and how long it took."""
    barrier.wait()
    tic = time.monotonic()
    try:
        reply = t.exchange("POST", "/v1/completions",
                           {"prompt": ref.prompt, "max_tokens": max_tokens})
    except (OSError, http.client.HTTPException) as exc:
        return failure_kind(exc), time.monotonic() - tic
    took = time.monotonic() - tic
    if reply.status == 200:
        text = reply.json()["choices"][0]["text"]
        return ("completed" if text == ref.text else "completed, text differs"), took
    if reply.status == 429:
        ok = (retry_after_s(reply.headers) or 0) >= 1 and is_json_error(reply)
        return ("429 with Retry-After" if ok else "429 without Retry-After/JSON"), took
    return f"HTTP {reply.status}", took


def run_overload(t: Target, args: argparse.Namespace) -> PhaseResult:
    """Far more simultaneous requests than max_running + max_waiting: each completes exactly or gets
    a 429 with Retry-After."""
    n = args.overload_requests or 4 * (t.max_running + t.max_waiting)
    ref = reference(t, "overload", args.overload_tokens)
    wait_drained(t, 30)
    barrier = threading.Barrier(n, timeout=60)
    started = time.monotonic()
    with ThreadPoolExecutor(n) as pool:
        outcomes = list(pool.map(
            lambda _: overload_one(t, ref, args.overload_tokens, barrier), range(n)))
    wall = time.monotonic() - started
    left = wait_drained(t, 60)
    kinds = Counter(kind for kind, _ in outcomes)
    refused = sorted(took for kind, took in outcomes if kind.startswith("429"))
    rows = [("simultaneous requests", n),
            ("max_running + max_waiting", t.max_running + t.max_waiting)]
    rows += [(f"answered: {kind}", count) for kind, count in sorted(kinds.items())]
    if refused:
        rows.append(("429 answered within (p50 / max)",
                     f"{refused[len(refused) // 2]:.3f} / {refused[-1]:.3f} s"))
    rows += [("wall", f"{wall:.1f} s"), ("after: anything held", dict(left) if any(
        left.values()) else "nothing"), ("health after", "ok" if health_ok(t) else "NOT OK")]
    good = kinds["completed"] + kinds["429 with Retry-After"]
    failures = [f"{n - good} requests neither completed exactly nor refused with 429: "
                f"{dict(kinds)}"] if good != n else []
    if not kinds["429 with Retry-After"]:
        rows.append(("note", "no 429: not overloaded; raise --overload-requests"))
    if any(left.values()) or not health_ok(t):
        failures.append("not drained or unhealthy afterwards")
    return PhaseResult("overload", rows, failures)
