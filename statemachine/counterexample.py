"""A checker's counterexample, replayed through the real Scheduler before it is printed.

The path of labels is re-run twice side by side: on the checker's own world with stable ids
(to map the canonical positions in the labels to sequences, and to learn how long each prompt
must be where the checker left lengths open), and through a `Scheduler` with `check=True` over
the same layout and claim configuration. What is printed is what the Scheduler did and raised:
its trace, with the trace's stable ids. A path the Scheduler does not break is a checker bug,
never a counterexample.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from statemachine.canonical import SOME
from statemachine.checker import Checker, Label
from statemachine.invariants import InvariantViolation, Violation
from statemachine.scheduler import Scheduler
from statemachine.tick import TickState
from statemachine.world import Plan, World


@dataclass(frozen=True)
class PathStep:
    """One step of a counterexample with stable ids: the label, the worlds around it, the
    stable ids its positions refer to, and the tick's plan."""

    label: Label
    before: World
    after: World
    ids: list[int]
    plan: Plan | None


def stable_path(checker: Checker, labels: list[Label], chunk: int) -> Iterator[PathStep]:
    """Re-run `labels` on the checker's world with ids that stay stable, step by step."""
    world, layout = World(), checker.run_layout(chunk)
    arrived = 0
    for label in labels:
        ids = [world.seqs[i].seq_id for i in checker.order(world)]
        plan = None
        if label[0] == "arrive":  # ids never come back, even when the newest has left
            after = world._replace(seqs=(*world.seqs, checker.arrival(arrived, label)))
            arrived += 1
        elif label[0] in ("abort", "finish"):
            pos = [s.seq_id for s in world.seqs].index(ids[label[1]])
            after = checker.apply(world, (label[0], pos), layout)[0]
        elif label[0] == "tick":
            plan, after, _ = checker.tick(world, label, layout)
        yield PathStep(label, world, after, ids, plan)
        world = after


class ReplayError(RuntimeError):
    """The Scheduler does not break where the checker says it does: a checker bug."""


@dataclass(frozen=True)
class Replay:
    """A counterexample as the Scheduler ran it."""

    steps: list[str]  # one line per label
    events: list[dict[str, Any]]  # the Scheduler's trace
    violations: list[Violation]  # what the Scheduler raised, stable ids
    lasso: tuple[int, int] | None  # steps i+1..j can repeat forever (starvation)


def replay(checker: Checker, labels: list[Label], chunk: int) -> Replay:
    """Run `labels` through a Scheduler; ReplayError if it raises nothing at the end."""
    path = list(stable_path(checker, labels, chunk))
    lengths = _prompt_lengths(path)
    sched = Scheduler(checker.policy, checker.run_layout(chunk), checker.lifecycle, check=True,
                      clock=lambda: 0.0, horizon=checker.horizon,
                      claims=(checker.claim_config(chunk), checker.max_grants))
    steps: list[str] = []
    for n, step in enumerate(path):
        try:
            _run(sched, step, lengths, steps)
        except InvariantViolation as exc:
            events = sched.trace.events()
            starving = next((v.seq for v in exc.violations if v.name == "no_starvation"), None)
            loop = _lasso(checker, path[:n + 1], starving) if starving is not None else None
            steps[-1] += ": the scheduler's own check raises"
            return Replay(steps, events, exc.violations, loop)
    raise ReplayError(f"the Scheduler ran the checker's {len(labels)}-step path without a "
                      "violation: a bug in the checker")


def _run(sched: Scheduler, step: PathStep, lengths: dict[int, int], steps: list[str]) -> None:
    label, kind = step.label, step.label[0]
    if kind == "arrive":
        seq = step.after.seqs[-1].seq_id
        sched.submit(seq, lengths[seq], label[2])
        size = f"{lengths[seq]} prompt tokens" if lengths[seq] < SOME else \
            "a prompt longer than this path"
        steps.append(f"seq {seq} arrives ({size}, max_tokens {label[2] or 'unbounded'})")
    elif kind in ("abort", "finish"):
        seq = step.ids[label[1]]
        (sched.abort if kind == "abort" else sched.finish)(seq)
        steps.append(f"seq {seq} {'aborts' if kind == 'abort' else 'finishes'}")
    else:
        steps.append(f"tick {sched.tick}")
        plan = sched.schedule(_budget(label[1]))
        steps[-1] += f": {plan.decision.action} (rule {plan.decision.rule})"
        if plan.decision.granted:
            steps[-1] += f", grants seq {', '.join(map(str, plan.decision.granted))}"
        if label[1] is not None:
            steps[-1] += f", budget {label[1]} tokens"
        if label[3]:
            steps[-1] += f", the decode rows step {1 + label[3]} times (a lane tick)"
        sched.complete(plan, extra=label[3])


def _budget(value: int | None) -> Callable[[TickState], int] | None:
    if value is None:
        return None
    return lambda _state: value


def _prompt_lengths(path: list[PathStep]) -> dict[int, int]:
    # Where the checker left lengths open, a prompt is as long as the slices granted to it
    # until the tick that ended it (or longer than the whole path, if none did).
    lengths: dict[int, int] = {}
    ran: dict[int, int] = {}
    for step in path:
        if step.label[0] == "arrive":
            seq = step.after.seqs[-1]
            lengths[seq.seq_id] = seq.prompt_len
        elif step.plan is not None:
            for work in step.plan.prefills:
                ran[work.seq_id] = ran.get(work.seq_id, 0) + work.num_tokens
                if work.seq_id in step.label[2]:
                    lengths[work.seq_id] = ran[work.seq_id]
    return lengths


def _lasso(checker: Checker, path: list[PathStep], seq: int) -> tuple[int, int] | None:
    # Steps i < j after which everything the policy can see is equal, with no grant to the
    # starving sequence between them: the steps i+1..j can repeat forever.
    seen: dict[Any, int] = {}
    last_grant = -1
    for n, step in enumerate(path):
        if step.plan is not None and seq in step.plan.decision.granted:
            last_grant = n
        if not any(s.seq_id == seq for s in step.after.seqs):
            continue
        key = checker.visible_key(step.after)
        if key in seen and seen[key] >= last_grant:
            return seen[key] + 1, n + 1
        seen[key] = n
    return None
