"""Hypothesis stateful test of the real scheduler core, at sizes beyond the exhaustive bounds.

Each example draws a layout (8-16 running, a chunk size, a KV budget or none) and then steps:
a burst of sequences arrives (any prompt length up to `max_chunks` chunks, a max_tokens), a live
one is aborted, a decoding one finishes, sibling choices fork from the prompts that just gave
their first token (with `Sizes.forks`), a burst of ticks runs (each with a drawn latency
budget where the policy has a target), or the arrivals stop while the ticks drain the waiting
sequences (without it, the states after a burst, streams decoding with nothing parked, came
in 2 of ~140 examples: one policy's rule fired or not as Hypothesis's constants, which it
takes from the project's loaded modules, changed with the tests run before). The Scheduler
runs with `check=True` and a finite starvation horizon, so every invariant and claim is checked
after every tick; `hypothesis.target` steers the search toward the longest waits, queues and
preemption counts. A failure shrinks to a short run, printed as the Scheduler's trace, with the
blob that replays it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, Phase, settings, target
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from statemachine.invariants import InvariantViolation
from statemachine.lifecycle import Lifecycle, Role, load_lifecycle
from statemachine.scheduler import Scheduler
from statemachine.tick import Policy, TickState
from statemachine.trace import format_table
from statemachine.world import Layout, Seq

DRAIN_TICKS = 40  # the most ticks one drain runs
WAITS = (Role.QUEUED, Role.PARKED, Role.PAUSED, Role.PREEMPTED)


@dataclass(frozen=True)
class Sizes:
    """The space the stateful test draws its layouts and requests from."""

    min_running: int = 8
    max_running: int = 16
    max_chunks: int = 20
    chunk_sizes: tuple[int, ...] = (1, 2, 3, 8, 512)
    max_tokens: int = 40
    kv_budgets: bool = True  # also draw KV budgets (small enough to preempt)
    horizon: int = 64  # a wait this long is starvation when wait_ticks is unbounded
    forks: bool = False  # also fork sibling choices (n > 1) from prompts at their first token
    burst: int | None = None  # most arrivals at once (None: twice the running limit)


def make_machine(policy: Policy, lifecycle: Lifecycle | None = None,
                 sizes: Sizes = Sizes()) -> type[RuleBasedStateMachine]:
    """A RuleBasedStateMachine class driving a Scheduler for `policy`; its class attribute
    `fired` counts the rules that decided ticks, over every example run."""
    life = lifecycle or load_lifecycle()
    has_target = policy.spec.tick_budget_ms is not None

    class SchedulerMachine(RuleBasedStateMachine):
        fired: Counter[str] = Counter()
        forks: Counter[bool] = Counter()  # siblings forked (True) or queued (False)
        extra: Counter[bool] = Counter()  # lane ticks whose rows stepped again (True) or not
        last_trace: Any = None

        @initialize(data=st.data())
        def layout(self, data: st.DataObject) -> None:
            running = data.draw(st.integers(sizes.min_running, sizes.max_running), "running")
            chunk = data.draw(st.sampled_from(sizes.chunk_sizes), "chunk size")
            most = sizes.max_chunks * chunk + sizes.max_tokens
            budget = data.draw(st.none() | st.integers(most, 4 * most), "kv budget") \
                if sizes.kv_budgets else None
            self.sched = Scheduler(policy, Layout(running, chunk, budget), life, check=True,
                                   horizon=sizes.horizon)
            self.next_id = 0
            self.edges = {(e.source, e.trigger.value, e.dest) for e in life.edges}
            self.seen_events = 0
            self.most = {"wait": 0, "queue": 0, "preemptions": 0}
            SchedulerMachine.last_trace = self.sched.trace

        @rule(count=st.integers(1, sizes.burst or 2 * sizes.max_running), data=st.data())
        def arrive(self, count: int, data: st.DataObject) -> None:
            # Bursts of arrivals: many prompts parked at once are the worst case for waits.
            chunk, limit = self.sched.layout.chunk_size, self.sched.layout.kv_budget
            room = 3 * self.sched.layout.max_running - len(self.sched.sequences())
            for _ in range(min(count, room)):
                tokens = data.draw(st.integers(1, sizes.max_chunks * chunk), "prompt tokens")
                max_tokens = data.draw(st.integers(1, sizes.max_tokens) if limit is not None
                                       else st.none() | st.integers(1, sizes.max_tokens),
                                       "max_tokens")
                self.sched.submit(self.next_id, tokens, max_tokens)
                self.next_id += 1

        @precondition(lambda self: bool(self.sched.sequences()))
        @rule(data=st.data())
        def abort(self, data: st.DataObject) -> None:
            live = [m.seq_id for m in self.sched.sequences()]
            self.sched.abort(data.draw(st.sampled_from(live), "abort"))

        @rule(data=st.data())
        def finish(self, data: st.DataObject) -> None:
            decoding = [m.seq_id for m in self.sched.sequences()
                        if self.sched.role(m.seq_id) is Role.DECODING]
            if decoding:
                self.sched.finish(data.draw(st.sampled_from(decoding), "finish"))

        @rule(ticks=st.integers(1, 40), data=st.data())
        def run_ticks(self, ticks: int, data: st.DataObject) -> None:
            for _ in range(ticks):
                budget = data.draw(st.integers(0, self.sched.layout.chunk_size + 1),
                                   "budget") if has_target else None
                self.tick(budget, data)
            self.note_most()

        @precondition(lambda self: self.waiting())
        @rule()
        def drain(self) -> None:
            # The arrivals stop for a while: ticks (whole slices, no extra steps, no siblings)
            # run until no sequence waits for its turn, at most DRAIN_TICKS of them, so that the
            # states after a burst (streams decoding, nothing parked) are explored too.
            for _ in range(DRAIN_TICKS):
                self.tick(self.sched.layout.chunk_size if has_target else None, None)
                if not self.waiting():
                    break
            self.note_most()

        def waiting(self) -> bool:
            # Some sequence waits for its turn: queued, parked, or preempted.
            return any(self.sched.role(m.seq_id) in WAITS for m in self.sched.sequences())

        def tick(self, budget: int | None, data: st.DataObject | None) -> None:
            # One tick; with `data`, the extra steps of a lane tick's rows and the siblings of
            # the prompts it gave first tokens to are drawn, else none.
            plan = self.sched.schedule(_fixed(budget))
            SchedulerMachine.fired[plan.decision.rule] += 1
            room = self.sched.extra_room(plan)  # a lane tick's rows may step again
            extra = data.draw(st.integers(0, min(room, 3)), "extra steps") \
                if room and data is not None else 0
            SchedulerMachine.extra[extra > 0] += bool(room)
            outcome = self.sched.complete(plan, extra=extra)
            if sizes.forks and data is not None:
                recs = {s.seq_id: s for s in plan.world.seqs}
                for seq_id, _, _ in outcome.completed:
                    self.fork(recs[seq_id], data.draw(st.integers(0, 3), "siblings"))

        def note_most(self) -> None:
            for s in self.sched.world().seqs:
                most = self.most
                most["wait"] = max(most["wait"], s.wait if s.role is Role.PARKED else 0)
                most["queue"], most["preemptions"] = max(most["queue"], s.queue), \
                    max(most["preemptions"], s.preemptions)

        def fork(self, parent: Seq, count: int) -> None:
            # Sibling choices (n > 1) of a prompt whose first token just came (it may have
            # finished with it), as the engine makes them: born decoding where they fit, else
            # queued arrivals.
            for _ in range(min(count, 3 * self.sched.layout.max_running -
                               len(self.sched.sequences()))):
                if not self.sched.fork(self.next_id, parent.seq_id, parent.prompt_len,
                                       parent.max_tokens):
                    self.sched.submit(self.next_id, parent.prompt_len, parent.max_tokens)
                SchedulerMachine.forks[self.sched.role(self.next_id) is Role.DECODING] += 1
                self.next_id += 1

        def teardown(self) -> None:
            # Steer the search toward the worst cases the claims bound.
            if hasattr(self, "most"):
                for label, value in self.most.items():
                    target(value, label=f"longest {label}")

        @invariant()
        def lifecycle_legal(self) -> None:
            events, self.seen_events = self.sched.trace.transitions(self.seen_events)
            for e in events:
                assert (e.src, e.trigger, e.dst) in self.edges, \
                    f"transition {e.to_dict()} is not declared in the lifecycle spec"

    SchedulerMachine.__name__ = f"SchedulerMachine_{policy.name}"
    return SchedulerMachine


def _fixed(budget: int | None) -> Callable[[TickState], int] | None:
    return None if budget is None else (lambda _state: budget)


def stateful_settings(examples: int = 200, steps: int = 50, shrink: bool = True,
                      derandomize: bool = False) -> settings:
    """Settings for a stateful run: `print_blob` so any failure can be replayed; without
    `shrink`, the first failure found is reported as it is (a quick yes/no); `derandomize`
    makes the run the same on every machine (for a test suite). Hypothesis's explain phase
    (which comments the parts of a shrunk failure that matter) is left out: it replays the
    shrunk run hundreds of times, most of a shrinking run's time, and the trace says more."""
    phases = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target]
    if shrink:
        phases.append(Phase.shrink)
    return settings(max_examples=examples, stateful_step_count=steps, deadline=None,
                    suppress_health_check=list(HealthCheck), database=None, print_blob=True,
                    phases=phases, report_multiple_bugs=False, derandomize=derandomize)


@dataclass(frozen=True)
class StatefulResult:
    """The shrunk failure as text (None: every claim held), how often each rule of the policy
    decided a tick over the whole run, how the sibling choices it forked went, and how many lane
    ticks' rows stepped again."""

    failure: str | None
    fired: Counter[str]
    forks: Counter[bool]  # sibling choices born decoding (True) or queued (False)
    extra: Counter[bool]  # lane ticks whose rows stepped past their one (True) or not


def run_stateful(policy: Policy, lifecycle: Lifecycle | None = None, sizes: Sizes = Sizes(),
                 examples: int = 200, steps: int = 50, shrink: bool = True,
                 derandomize: bool = False) -> StatefulResult:
    """Run the stateful test."""
    machine: Any = make_machine(policy, lifecycle, sizes)
    try:
        run_state_machine_as_test(machine, settings=stateful_settings(examples, steps, shrink,
                                                                      derandomize))
    except (AssertionError, InvariantViolation) as exc:
        trace = machine.last_trace
        table = format_table(trace.events()[-200:]) if trace is not None else ""
        notes = "\n".join(f"  {note}" for note in getattr(exc, "__notes__", ()))
        return StatefulResult(f"  {exc}\n{notes}\n  trace of the failing run (last 200 "
                              "events):\n" + "\n".join("    " + line
                                                       for line in table.splitlines()),
                              machine.fired, machine.forks, machine.extra)
    return StatefulResult(None, machine.fired, machine.forks, machine.extra)
