"""Hypothesis stateful test of the real scheduler core, at sizes beyond the exhaustive bounds.

Rules: a sequence arrives (any prompt length up to `max_chunks` chunks), a live sequence is
aborted, a tick runs (some of the sequences that decoded in it finish). After every step the
shared invariants and the policy's claims are checked; a failure shrinks to a short sequence
of steps, printed as the trace of the scheduler core.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from statemachine.invariants import (
    InvariantViolation,
    check_claims,
    check_decision,
    check_slots,
)
from statemachine.scheduler import Scheduler
from statemachine.tick import Policy
from statemachine.trace import format_table

CHUNK = 4  # tokens per chunk in the test; prompt lengths are drawn in tokens


def make_machine(policy: Policy, slots: int, max_chunks: int) -> type[RuleBasedStateMachine]:
    """A RuleBasedStateMachine class driving a Scheduler for `policy`."""

    class SchedulerMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.sched = Scheduler(policy, slots, CHUNK)
            self.next_id = 0
            self.edges = {(e.source, e.trigger, e.dest) for e in self.sched.lifecycle.edges}
            self.seen_events = 0
            SchedulerMachine.last_trace = self.sched.trace

        @rule(tokens=st.integers(1, max_chunks * CHUNK))
        def arrive(self, tokens: int) -> None:
            if len(self.sched.sequences()) < 2 * slots:
                self.sched.submit(self.next_id, tokens)
                self.next_id += 1

        @rule(data=st.data())
        def abort(self, data: st.DataObject) -> None:
            live = [s.seq_id for s in self.sched.sequences()]
            if live:
                self.sched.abort(data.draw(st.sampled_from(live), label="abort"))

        @rule(data=st.data())
        def tick(self, data: st.DataObject) -> None:
            plan = self.sched.schedule()
            problems = check_decision(plan.state, plan.decision)
            finished = data.draw(st.sets(st.sampled_from(plan.decode)) if plan.decode
                                 else st.just(set()), label="finished")
            self.sched.complete(plan, finished)
            completed = tuple((s.seq_id, s.age_ticks, s.num_grants)
                              for s in self.sched.sequences()
                              if s.state == "decoding" and s.seq_id in plan.decision.granted)
            problems += check_claims(self.sched.tick_state(), self.sched.bounds(), completed)
            if problems:
                raise InvariantViolation(problems)

        @invariant()
        def slots_conserved(self) -> None:
            problems = check_slots(self.sched.num_holding_slots, slots)
            if problems:
                raise InvariantViolation(problems)

        @invariant()
        def lifecycle_legal(self) -> None:
            events = self.sched.trace.events()
            for e in events[self.seen_events:]:
                assert (e["from"], e["trigger"], e["to"]) in self.edges, \
                    f"transition {e} is not declared in the lifecycle spec"
            self.seen_events = len(events)

    SchedulerMachine.__name__ = f"SchedulerMachine_{policy.name}"
    SchedulerMachine.last_trace = None
    return SchedulerMachine


def stateful_settings(examples: int = 200, steps: int = 50) -> settings:
    return settings(max_examples=examples, stateful_step_count=steps, deadline=None,
                    suppress_health_check=list(HealthCheck), database=None)


def run_stateful(policy: Policy, slots: int, max_chunks: int, examples: int = 200,
                 steps: int = 50) -> str | None:
    """Run the stateful test; None if every claim held, else the shrunk failure as text."""
    machine: Any = make_machine(policy, slots, max_chunks)
    try:
        run_state_machine_as_test(machine, settings=stateful_settings(examples, steps))
    except (AssertionError, InvariantViolation) as exc:
        trace = machine.last_trace
        table = format_table(trace.events()) if trace is not None else ""
        return f"  {exc}\n  trace of the shrunk failing run:\n" + \
            "\n".join("    " + line for line in table.splitlines())
    return None
