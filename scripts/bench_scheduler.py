"""Scheduler core cost per tick (decide_tick + triggers + bookkeeping), no model involved.

    .venv/bin/python scripts/bench_scheduler.py [--policy NAME] [--ticks N]

For 8 and 64 live sequences (a quarter of them long prompts, parked or prefilling, the rest
decoding) it runs schedule() + complete() in a loop and prints microseconds per tick, and the
ratio to a ~4 ms batched decode step (the cost it must stay far below).
"""

from __future__ import annotations

import argparse
import time

from statemachine.scheduler import Scheduler
from statemachine.tick import make_policy
from statemachine.world import Layout

DECODE_STEP_S = 0.004  # one batched decode step of the built-in model on 2 cores


def per_tick_us(policy_name: str, num_seqs: int, ticks: int) -> float:
    sched = Scheduler(make_policy(policy_name), Layout(max_running=num_seqs, chunk_size=512,
                                                       kv_budget=num_seqs * 20_000))
    next_id = 0

    def top_up() -> None:
        nonlocal next_id
        while len(sched.sequences()) < num_seqs:
            long_prompt = next_id % 4 == 0
            sched.submit(next_id, 512 * 19 if long_prompt else 64, 4096)
            next_id += 1

    top_up()
    for _ in range(200):  # warm up: get the mix of parked and decoding sequences going
        sched.complete(sched.schedule())
    start = time.perf_counter()
    for tick in range(ticks):
        plan = sched.schedule()
        # Every 50th tick a decoding sequence finishes and a new one arrives (lifecycle churn).
        finished = plan.decode[:1] if tick % 50 == 0 else ()
        sched.complete(plan, finished)
        if finished:
            top_up()
    return (time.perf_counter() - start) / ticks * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="default")
    parser.add_argument("--ticks", type=int, default=5000)
    args = parser.parse_args()
    print(f"policy {make_policy(args.policy).name}, {args.ticks} ticks per size")
    print(f"{'sequences':>9}  {'us/tick':>8}  {'share of a 4 ms decode step':>28}")
    for n in (8, 64):
        us = per_tick_us(args.policy, n, args.ticks)
        print(f"{n:>9}  {us:>8.1f}  {us / (DECODE_STEP_S * 1e6):>27.2%}")


if __name__ == "__main__":
    main()
