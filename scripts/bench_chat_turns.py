"""Multi-turn chats with and without the prefix cache, side by side in one run: C conversations
interleaved (one client thread each), T turns each, against one real `fairtick serve` at its
default flags.

    python scripts/bench_chat_turns.py --conversations 4 --turns 8 --repeats 2

A turn appends a user message of `--user-tokens` characters (one token each on the built-in
model) to the conversation so far and streams the greedy answer (`--max-tokens`), which the
next turn carries as the assistant's message: with the defaults the 8th turn's prompt is about
8,000 tokens. Each repeat runs the same conversations twice on the same server: with
`"cache_prompt": true` (a turn reuses the conversation so far) and with `false` (a turn
prefills it all; such requests neither use nor fill the cache, so one phase leaves nothing for
the other). Repeats alternate which phase runs first, so a drift of the shared machine's load
falls on both. The answers must be the same in both phases (checked): both send the same
prompts. Prints one JSON line per turn, then per turn the TTFT p50 / p95 / p99 / max of each
phase and cold / cached at p50; `--out FILE` keeps every turn and the summary as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib.chat import ChatTiming, load_average, make_text, summary, timed_chat  # noqa: E402
from benchlib.client import wait_idle  # noqa: E402
from benchlib.serve import start_server, stop_server  # noqa: E402
from benchlib.windows import percentile  # noqa: E402
from openai import OpenAI  # noqa: E402

PHASES = {True: "cached", False: "cold"}


def converse(client: OpenAI, model: str, questions: list[str], max_tokens: int,
             cache: bool) -> list[ChatTiming]:
    """One conversation: each question after the previous turns and their answers."""
    messages: list[dict[str, str]] = []
    timings = []
    for question in questions:
        messages.append({"role": "user", "content": question})
        timing = timed_chat(client, model, messages, max_tokens, cache)
        messages.append({"role": "assistant", "content": timing.text})
        timings.append(timing)
    return timings


def run_phase(client: OpenAI, model: str, conversations: list[list[str]], max_tokens: int,
              cache: bool) -> list[list[ChatTiming]]:
    """Every conversation at once, one thread each; their turns interleave on the server."""
    with ThreadPoolExecutor(len(conversations)) as pool:
        return list(pool.map(lambda qs: converse(client, model, qs, max_tokens, cache),
                             conversations))


def turn_rows(repeat: int, phase: str, timings: list[list[ChatTiming]]) -> list[dict[str, Any]]:
    """One row a turn; `new_tokens`: the prompt's tokens past the previous turn's prompt and
    answer (the new question and the template's markers)."""
    rows = []
    for conv, turns in enumerate(timings):
        previous = 0
        for turn, t in enumerate(turns, start=1):
            rows.append({"repeat": repeat, "phase": phase, "conversation": conv, "turn": turn,
                         "prompt_tokens": t.prompt_tokens, "cached_tokens": t.cached_tokens,
                         "prefilled_tokens": t.prompt_tokens - t.cached_tokens,
                         "new_tokens": t.prompt_tokens - previous,
                         "ttft_s": round(t.ttft_s, 4)})
            previous = t.prompt_tokens + t.completion_tokens
    return rows


def per_turn(rows: list[dict[str, Any]], turns: int) -> list[dict[str, Any]]:
    """Per turn: median token counts of the cached phase, TTFT percentiles of each phase."""
    out = []
    for turn in range(1, turns + 1):
        mine = [r for r in rows if r["turn"] == turn]
        hit = [r for r in mine if r["phase"] == "cached"]
        entry: dict[str, Any] = {"turn": turn}
        for key in ("prompt_tokens", "cached_tokens", "prefilled_tokens", "new_tokens"):
            entry[key] = percentile([r[key] for r in hit], 50)
        for phase in PHASES.values():
            ttft = [r["ttft_s"] for r in mine if r["phase"] == phase]
            entry[phase] = {f"p{q}": percentile(ttft, q) for q in (50, 95, 99)}
            entry[phase]["max"], entry[phase]["n"] = max(ttft), len(ttft)
        entry["cold_over_cached_p50"] = entry["cold"]["p50"] / entry["cached"]["p50"]
        out.append(entry)
    return out


def print_table(summary_rows: list[dict[str, Any]]) -> None:
    print("| turn | prompt tokens | cached | prefilled | new | TTFT cached p50 / p95 / p99 / "
          "max s | TTFT cold p50 / p95 / p99 / max s | cold / cached (p50) |")
    print("|---|---|---|---|---|---|---|---|")
    for e in summary_rows:
        cells = [" / ".join(f"{e[p][k]:.3f}" for k in ("p50", "p95", "p99", "max"))
                 for p in PHASES.values()]
        print(f"| {e['turn']} | {e['prompt_tokens']:.0f} | {e['cached_tokens']:.0f} | "
              f"{e['prefilled_tokens']:.0f} | {e['new_tokens']:.0f} | {cells[0]} | {cells[1]} | "
              f"{e['cold_over_cached_p50']:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--user-tokens", type=int, default=950,
                        help="characters of each user message (950)")
    parser.add_argument("--max-tokens", type=int, default=32, help="of each answer (32)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="a JSON file of every turn")
    args = parser.parse_args()
    if min(args.conversations, args.turns, args.user_tokens, args.max_tokens,
           args.repeats) < 1:
        parser.error("--conversations, --turns, --user-tokens, --max-tokens and --repeats "
                     "must be at least 1")
    server = start_server([], Path(tempfile.mkdtemp()) / "serve.log")
    rows: list[dict[str, Any]] = []
    phases_run = []
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                        timeout=1800)
        model = client.models.list().data[0].id
        for repeat in range(args.repeats):
            conversations = [[make_text(args.user_tokens, f"{repeat}-{c}-{k}")
                              for k in range(args.turns)] for c in range(args.conversations)]
            answers = {}
            for cache in (True, False) if repeat % 2 == 0 else (False, True):
                wait_idle(server.url)  # the last phase's KV is in the cache (or was not kept)
                before, started = load_average(), time.monotonic()
                timings = run_phase(client, model, conversations, args.max_tokens, cache)
                phase = {"repeat": repeat, "phase": PHASES[cache], "load_before": before,
                         "load_after": load_average(),
                         "seconds": round(time.monotonic() - started, 1)}
                phases_run.append(phase)
                print(json.dumps(phase), flush=True)
                answers[cache] = [[t.text for t in turns] for turns in timings]
                for row in turn_rows(repeat, PHASES[cache], timings):
                    print(json.dumps(row), flush=True)
                    rows.append(row)
            assert answers[True] == answers[False], "greedy answers must not depend on the cache"
    finally:
        stop_server(server)
    summary_rows = per_turn(rows, args.turns)
    print_table(summary_rows)
    for phase in PHASES.values():
        later = [r["ttft_s"] for r in rows if r["phase"] == phase and r["turn"] > 1]
        print(f"turns 2-{args.turns}, {phase}: {summary(later)}")
    if args.out is not None:
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "phases": phases_run,
                                        "per_turn": summary_rows, "turns": rows}, indent=1))


if __name__ == "__main__":
    main()
