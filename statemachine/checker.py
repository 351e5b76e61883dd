"""`fairtick check`'s engine: exhaustive, bounded, breadth-first exploration of a policy.

The world is a real (small) scheduler configuration: at most `max_seqs` live sequences, prompts
of 1..`max_chunks` chunks, `max_running` running, optionally a KV budget and a largest
`max_tokens`. Between ticks the environment may let a sequence arrive, abort any live one, or
finish a decoding one; a tick is the scheduler's own step function (statemachine.world) with
the real `decide_tick`, and, where the policy has a latency target, every budget the spec's
comparisons tell apart. Every interleaving is explored; a state that violates a claim is not
expanded further. The abstractions (statemachine.abstraction) are exact by construction:
capped counters, one observed sequence whose claim counters are tracked (any sequence can be
the observed one), its queue wait found as a longest path rather than kept in the state
(statemachine.paths), and, where no preemption can happen, running sequences the policy cannot
tell apart kept in a canonical order.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import resource
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from statemachine.abstraction import MAX_CHUNK_SIZE, Abstraction, analyse
from statemachine.canonical import SOME, Canon, Key
from statemachine.invariants import (
    Bounds,
    ClaimConfig,
    Violation,
    check_capacity,
    check_claims,
    check_decision,
)
from statemachine.lifecycle import Lifecycle, Role, Trigger, load_lifecycle
from statemachine.paths import longest
from statemachine.tick import Decision, Policy, TickState, decide_tick
from statemachine.world import (
    Layout,
    Plan,
    Seq,
    World,
    admissible,
    arrange,
    begin_tick,
    end_tick,
    extra_room,
    grant,
    lane_tick,
    leave,
)

Label = tuple[Any, ...]  # ("arrive", tokens, max_tokens, observed) | ("abort", i) |
# ("finish", i) | ("tick", budget or None, granted seqs whose slice ends their prompt, the
# decode rows' steps past their one: 0, or 1 in a lane tick);
# indices are positions in the canonical order
Moved = tuple[bool, int] | None  # (restarted, amount): the observed queue wait's move
_MARK = 1 << 30  # the observed queue wait before a tick: what it is after tells how it moved


@dataclass(frozen=True)
class CheckLayout:
    """The configuration explored. `max_tokens=None`: streams may decode forever (the worst
    case for fairness); a KV budget needs a finite `max_tokens`."""

    max_seqs: int = 5
    max_chunks: int = 4
    max_running: int = 4
    max_tokens: int | None = None
    kv_budget: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_seqs", "max_chunks", "max_running", "max_tokens", "kv_budget"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.kv_budget is not None and self.max_tokens is None:
            raise ValueError("a KV budget needs a finite --max-tokens")

    @property
    def name(self) -> str:
        return "streams" if self.kv_budget is None else "memory"

    def describe(self) -> str:
        gen = "unbounded" if self.max_tokens is None else f"<= {self.max_tokens}"
        kv = "unlimited" if self.kv_budget is None else f"{self.kv_budget} tokens"
        return (f"{self.max_seqs} sequences, 1..{self.max_chunks} chunks, {self.max_running} "
                f"running, max_tokens {gen}, KV {kv}")


STREAMS = CheckLayout()
MEMORY = CheckLayout(max_seqs=4, max_chunks=2, max_running=3, max_tokens=2, kv_budget=5)


@dataclass
class Report:
    """What a check found."""

    policy: Policy
    layout: CheckLayout
    bounds: Bounds
    abstraction: Abstraction
    states: int = 0
    edges: int = 0
    depth: int = 0
    seconds: float = 0.0
    peak_rss_mb: float = 0.0
    max_seen: dict[str, int] = field(default_factory=dict)
    # claim -> (violation, path of labels, chunk size)
    counterexamples: dict[str, tuple[Violation, list[Label], int]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.counterexamples


class Checker:
    """Explores every interleaving for one policy and layout."""

    def __init__(self, policy: Policy, layout: CheckLayout = STREAMS,
                 lifecycle: Lifecycle | None = None, horizon: int = 8,
                 reduce: bool = True, queue_paths: bool = True) -> None:
        self.policy, self.layout, self.horizon = policy, layout, horizon
        self.lifecycle = lifecycle or load_lifecycle()
        if layout.kv_budget is not None:
            from statemachine.scheduler import require_kv_roles

            require_kv_roles(self.lifecycle, policy)
        self.max_grants = layout.max_chunks * MAX_CHUNK_SIZE * 4
        self._bounds: dict[int, Bounds] = {}
        self.abs = analyse(policy, self.bounds, layout.max_running, layout.max_seqs,
                           layout.kv_budget, horizon)
        # reduce=False: the naive explorer (for tests of the reductions): arrival order, every
        # sequence's counters tracked, no ranks.
        self.reduce = reduce
        if not reduce:
            over = self.bounds(self.abs.chunk_sizes[-1]).overtakes
            self.abs = dataclasses.replace(self.abs, sort_parked=False, rank_waits=False,
                                           wait_visible=True, overtakes_follow=False,
                                           overtaken_cap=0 if over is None else over + 1)
        a = self.abs
        self.tracks_observed = reduce and (not a.wait_visible or a.rank_waits or any(
            (a.overtaken_cap, a.queue_cap, a.preemptions_cap, a.age_cap, a.grants_cap)))
        # Without preemption, only arrival order within the parked and the queued matters.
        self.grouped = reduce and (layout.kv_budget is None or policy.spec.kv_full == "queue")
        # No transition reads the queue wait: with a claim on it, keys drop it and its largest
        # value is a longest path (statemachine/paths.py); queue_paths=False keeps it in keys.
        self.queue_paths = queue_paths and reduce and a.queue_cap > 0
        keyed = dataclasses.replace(a, queue_cap=0) if self.queue_paths else a
        self.canon = Canon(keyed, layout.kv_budget, layout.max_tokens, self.grouped, reduce)
        self.key, self.decode, self.order = self.canon.key, self.canon.decode, self.canon.order
        self.visible_key = self.canon.visible_key
        self._decisions: dict[TickState, Decision] = {}

    def claim_config(self, chunk: int) -> ClaimConfig:
        """The configuration the claims are stated for, with prompts of this chunk size."""
        lay = self.layout
        return ClaimConfig(lay.max_running, lay.max_seqs, lay.max_chunks,
                           lay.max_chunks * chunk, lay.max_tokens)

    def bounds(self, chunk: int) -> Bounds:
        """The policy's claims for prompts of this chunk size."""
        if chunk not in self._bounds:
            self._bounds[chunk] = Bounds.of(self.policy, self.claim_config(chunk),
                                            self.max_grants, self.horizon)
        return self._bounds[chunk]

    # -- exploration ------------------------------------------------------------------------
    def run(self, time_limit_s: float | None = None) -> Report:
        """Breadth-first search of the whole bounded state space, for every chunk size the
        spec's comparisons tell apart."""
        report = Report(self.policy, self.layout, self.bounds(self.abs.chunk_sizes[-1]),
                        self.abs)
        start = time.perf_counter()
        for chunk in self.abs.chunk_sizes:
            self._explore(chunk, report, start, time_limit_s)
        report.seconds = time.perf_counter() - start
        report.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return report

    def _explore(self, chunk: int, report: Report, start: float, limit: float | None) -> None:
        layout = self.run_layout(chunk)
        root = self.key(World())
        parents: dict[Key, tuple[Key, Label] | None] = {root: None}
        queue = deque([(root, 0)])
        # The queue wait's moves, for its longest path: grew by w (adds), restarted (starts).
        adds: dict[Key, list[tuple[Key, int]]] = {}
        starts: dict[Key, int] = {}
        while queue:
            key, depth = queue.popleft()
            report.depth = max(report.depth, depth)
            for label, nkey, violations, moved in self._successors(key, chunk, layout, report):
                report.edges += 1
                if violations:
                    for v in violations:
                        if v.name not in report.counterexamples:
                            path = self._path(parents, key) + [label]
                            report.counterexamples[v.name] = (v, path, chunk)
                    continue  # a violating state is not expanded: its counters may be capped
                if moved is not None:
                    restarted, amount = moved
                    if restarted:
                        starts[nkey] = max(starts.get(nkey, 0), amount)
                    else:
                        adds.setdefault(key, []).append((nkey, amount))
                if nkey not in parents:
                    parents[nkey] = (key, label)
                    queue.append((nkey, depth + 1))
            if limit is not None and time.perf_counter() - start > limit:
                raise TimeoutError(f"state space not exhausted after {limit:g} s "
                                   f"({report.states + len(parents):,} states): lower the bounds")
        report.states += len(parents)
        if self.queue_paths:
            self._settle_queue(adds, starts, chunk, report, start, limit)

    def _settle_queue(self, adds: dict[Key, list[tuple[Key, int]]], starts: dict[Key, int],
                      chunk: int, report: Report, start: float, limit: float | None) -> None:
        # Within the claim the longest path is the exact largest queue wait; past it, explore
        # this chunk size again with the wait in the keys, for the counterexample.
        bound = self.bounds(chunk).queue_ticks
        most = longest(adds, starts, self.abs.queue_cap if bound is None else bound)
        if bound is not None and most > bound:
            exact = Checker(self.policy, self.layout, self.lifecycle, self.horizon,
                            queue_paths=False)
            exact._explore(chunk, report, start, limit)
        else:
            report.max_seen["queue_ticks"] = max(report.max_seen.get("queue_ticks", 0), most)

    @staticmethod
    def _path(parents: dict[Key, tuple[Key, Label] | None], key: Key) -> list[Label]:
        labels: list[Label] = []
        link = parents[key]
        while link is not None:
            key, label = link
            labels.append(label)
            link = parents[key]
        return labels[::-1]

    def _observe(self, report: Report, world: World) -> None:
        seen, exact_wait = report.max_seen, self.abs.wait_visible and not self.abs.rank_waits
        for s in world.seqs:
            if exact_wait and s.role is Role.PARKED:
                seen["wait_ticks"] = max(seen.get("wait_ticks", 0), s.wait)
            if not s.observed:
                continue
            for claim, value in (("wait_ticks", s.wait if s.role is Role.PARKED else 0),
                                 ("overtakes", s.overtaken if s.role is Role.PARKED else 0),
                                 ("preemptions", s.preemptions)):
                seen[claim] = max(seen.get(claim, 0), value)
            if not self.queue_paths:
                seen["queue_ticks"] = max(seen.get("queue_ticks", 0), s.queue)
        seen["decode_wait_ticks"] = max(seen.get("decode_wait_ticks", 0), world.dwait)

    def run_layout(self, chunk: int) -> Layout:
        """The scheduler layout one exploration runs."""
        return Layout(self.layout.max_running, chunk, self.layout.kv_budget)

    def _successors(self, key: Key, chunk: int, layout: Layout,
                    report: Report) -> Iterator[tuple[Label, Key, list[Violation], Moved]]:
        # Environment steps act on the canonical key itself (an arrival joins the end, a
        # departure leaves its place: both keep the order canonical); a tick runs the step
        # function on the decoded world. The last item: how the observed sequence's queue
        # wait moved, where it is tracked as a path and the same sequence stays observed.
        streak, dwait, *recs = key
        lay, n = self.layout, len(recs)
        observing = any(r[1] for r in recs)
        kept: Moved = (False, 0) if observing and self.queue_paths else None
        if n < lay.max_seqs:
            for label, rec in self._arrival_keys(chunk, observing):
                yield label, (*key, rec), [], kept
        for i, r in enumerate(recs):
            rest = recs[:i] + recs[i + 1:]
            left = (streak, dwait if any(x[0] == Role.DECODING for x in rest) else 0, *rest)
            if self.abs.rank_waits and r[0] is Role.PARKED:
                left = self.key(self.decode(left))  # the ranks below it close up
            moved = kept if kept is not None and _observing(left) else None
            yield ("abort", i), left, [], moved
            if r[0] == Role.DECODING:
                yield ("finish", i), left, [], moved
        world = self.decode(key)
        if kept is not None:  # mark its wait, to read how the step function moves it
            world = world._replace(seqs=tuple(s._replace(queue=_MARK) if s.observed else s
                                              for s in world.seqs))
        for label, nxt, violations in self.ticks(world, chunk, layout):
            # A violating state counts too: "max seen" is then at least the counterexample's
            # value (its counters may be capped past the bound, never raised).
            self._observe(report, nxt)
            nkey = self.key(nxt)
            yield label, nkey, violations, None if kept is None else _moved(nxt, nkey)

    @functools.cache  # noqa: B019 - one checker per policy and layout, a handful of keys
    def _arrival_keys(self, chunk: int, observing: bool) -> list[tuple[Label, Key]]:
        return [(label, self.canon.seq_key(self.arrival(0, label)))
                for label in self.arrivals(chunk, observing)]

    def arrivals(self, chunk: int, observing: bool) -> Iterator[Label]:
        """The arrival labels: every prompt length (any length at all, as one label, when
        progress is not tracked), every max_tokens, observed or not (when none is)."""
        lay = self.layout
        observe = (False, True) if self.tracks_observed and not observing else \
            (False,) if self.reduce else (True,)
        gens = range(1, lay.max_tokens + 1) if lay.max_tokens is not None else (None,)
        sizes = range(1, lay.max_chunks * chunk + 1) if self.abs.progress else (None,)
        for tokens in sizes:
            for max_tokens in gens:
                if tokens is not None and admissible(tokens, max_tokens, lay.kv_budget):
                    continue  # refused at submission: never queued
                for obs in observe:
                    yield ("arrive", tokens, max_tokens, obs)

    @staticmethod
    def arrival(seq_id: int, label: Label) -> Seq:
        """The sequence an arrival label brings (length None: SOME tokens, never all run)."""
        _, tokens, max_tokens, obs = label
        size = SOME if tokens is None else tokens
        return Seq(seq_id, Role.QUEUED, size, max_tokens, size, observed=obs)

    def ticks(self, world: World, chunk: int,
              layout: Layout) -> Iterator[tuple[Label, World, list[Violation]]]:
        """Every tick from `world`: one per budget the policy asks about (where it has a
        latency target), times, without tracked progress, which granted prompts end."""
        budgets = self.abs.budgets.get(chunk, (None,))
        arranged = arrange(world, self.policy, self.lifecycle, layout)
        decided, asked = set(), []

        def ask(budget: int) -> Callable[[TickState], int]:
            def give(_state: TickState) -> int:
                asked.append(budget)
                return budget
            return give

        for budget in budgets:
            plan = grant(arranged, self.policy, self.lifecycle,
                         None if budget is None else ask(budget), self._decide)
            if plan.decision not in decided:  # else another budget decided the same tick
                decided.add(plan.decision)
                granted = plan.decision.granted if not self.abs.progress else ()
                lane = lane_tick(plan, self.policy)
                for ends in itertools.product((False, True), repeat=len(granted)):
                    done = tuple(g for g, e in zip(granted, ends, strict=True) if e)
                    yield ("tick", budget, done, 0), *self._end(plan, done, layout)
                    # A lane tick's rows may take a step past their one (ADR 0016): one more
                    # stands for any more (what it moves is a row's finish and the KV room).
                    if lane and extra_room(self._progressed(plan, done), self.lifecycle,
                                           self.policy.spec.kv_full, layout) >= 1:
                        yield ("tick", budget, done, 1), *self._end(plan, done, layout, 1)
            if not asked:
                break  # the step never asked for its budget: every budget runs this tick

    def _progressed(self, plan: Plan, done: tuple[int, ...]) -> Plan:
        # `plan` with the granted prompts' lengths set as `done` says, where not tracked.
        if not self.abs.progress and plan.prefills:
            return self._set_progress(plan, done)
        return plan

    def _end(self, plan: Plan, done: tuple[int, ...], layout: Layout,
             extra: int = 0) -> tuple[World, list[Violation]]:
        plan = self._progressed(plan, done)
        outcome = end_tick(plan, self.lifecycle, extra)
        violations = check_decision(plan.state, plan.decision) + \
            check_capacity(outcome.world.seqs, layout) + \
            check_claims(outcome, self._stepwise(layout.chunk_size))
        return outcome.world, violations

    def apply(self, world: World, label: Label, layout: Layout) -> tuple[World, list[Violation]]:
        """The world after `label` (indices are positions in `world`), and what it violated."""
        kind = label[0]
        if kind == "arrive":
            next_id = max((s.seq_id for s in world.seqs), default=-1) + 1
            return world._replace(seqs=(*world.seqs, self.arrival(next_id, label))), []
        if kind in ("abort", "finish"):
            trigger = Trigger.ABORT if kind == "abort" else Trigger.FINISH
            return leave(world, world.seqs[label[1]].seq_id, trigger, self.lifecycle)[0], []
        assert kind == "tick", label
        return self.tick(world, label, layout)[1:]

    def tick(self, world: World, label: Label,
             layout: Layout) -> tuple[Plan, World, list[Violation]]:
        """A tick label's plan, the world after it, and what it violated."""
        _, budget, done, extra = label
        plan = begin_tick(world, self.policy, self.lifecycle, layout, self._give(budget),
                          self._decide)
        return (plan, *self._end(plan, done, layout, extra))

    @staticmethod
    def _give(budget: int | None) -> Callable[[TickState], int] | None:
        if budget is None:
            return None
        return lambda _state: budget

    @staticmethod
    def _set_progress(plan: Plan, ends: tuple[int, ...]) -> Plan:
        # Prompts of unknown length: each granted slice is the last one or not, as the label
        # says (a prompt not yet ended has SOME tokens left, as many as a slice can take).
        slices = {w.seq_id: w.num_tokens for w in plan.prefills}
        seqs = tuple(s._replace(target=s.prefilled + slices[s.seq_id] + (
            0 if s.seq_id in ends else SOME)) if s.seq_id in slices else s
            for s in plan.world.seqs)
        return Plan(plan.world._replace(seqs=seqs), plan.state, plan.decision, plan.prefills,
                    plan.decode, plan.events)

    @functools.cache  # noqa: B019 - one checker per policy and layout, a handful of sizes
    def _stepwise(self, chunk: int) -> Bounds:
        # The claims checked at each step: the queue wait, when tracked as a path, is not.
        bounds = self.bounds(chunk)
        return dataclasses.replace(bounds, queue_ticks=None) if self.queue_paths else bounds

    def _decide(self, state: TickState, policy: Policy) -> Decision:
        # The real decide_tick, remembered: it is pure, and many worlds share a TickState.
        decision = self._decisions.get(state)
        if decision is None:
            decision = self._decisions[state] = decide_tick(state, policy)
        return decision


def _observing(key: Key) -> bool:
    return any(r[1] for r in key[2:])


def _moved(nxt: World, nkey: Key) -> Moved:
    # The marked wait grew (or stayed) unless the tick restarted it; None: it left, or the
    # key stopped observing it.
    wait = next((s.queue for s in nxt.seqs if s.observed), None)
    if wait is None or not _observing(nkey):
        return None
    return (False, wait - _MARK) if wait >= _MARK else (True, wait)
