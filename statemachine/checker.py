"""`fairtick check`: exhaustive, bounded, breadth-first exploration of a policy.

The model: at most `max_seqs` live sequences, each prompt 1..`max_chunks` chunks, `slots`
slots. Between ticks the environment may let a sequence arrive, abort any live sequence, or
finish a decoding one; a tick admits waiting sequences FIFO, asks the real `decide_tick`, and
applies the Decision through the lifecycle spec's edges. Every interleaving is explored.

The state is each live sequence's (phase, prefill left, chunks, wait, age, overtaken) in
arrival order plus the decode streak and decode wait. Terminal sequences are dropped and ids
renumbered, which is exact (identities never matter, only order). Counters are capped one past
the claimed bound (a larger value is already a violation), or at the starvation horizon when
the claim is `unbounded`; counters no claim or rule reads are not tracked at all. This is exact
as long as rule conditions compare counters only against thresholds below those caps.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from statemachine.invariants import (
    UNIVERSAL,
    Bounds,
    Violation,
    check_claims,
    check_decision,
    check_slots,
)
from statemachine.lifecycle import Lifecycle, load_lifecycle
from statemachine.spec import CLAIMS
from statemachine.tick import (
    ParkedPrefill,
    Policy,
    PolicyMemory,
    TickState,
    decide_tick,
    decode_wait_after_tick,
    parked_after_tick,
)


class SeqRec(NamedTuple):
    """One sequence in the checker's state (a tuple: states are hashed millions of times)."""

    seq_id: int
    phase: str
    prefill_left: int
    num_chunks: int
    wait: int = 0
    age: int = 0
    overtaken: int = 0

    def has_prefill_left(self) -> bool:
        return self.prefill_left > 0


class World(NamedTuple):
    seqs: tuple[SeqRec, ...]
    streak: int = 0
    dwait: int = 0


Label = tuple[str, int]  # ("arrive", chunks) | ("abort", index) | ("finish", index) | ("tick", 0)


@dataclass(frozen=True)
class Step:
    """One explored edge: the label, the resulting world, trace events, violations."""

    label: Label
    world: World
    events: tuple[tuple[int, str, str, str, str], ...]  # (seq, from, to, trigger, rule)
    violations: tuple[Violation, ...]
    note: str = ""


@dataclass
class Report:
    """What a check found."""

    policy: Policy
    max_seqs: int
    max_chunks: int
    slots: int
    bounds: Bounds
    states: int = 0
    edges: int = 0
    depth: int = 0
    seconds: float = 0.0
    max_seen: dict[str, int] = field(default_factory=dict)
    counterexamples: dict[str, tuple[Violation, list[Label]]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.counterexamples


class Checker:
    """Explores every interleaving for one policy and configuration."""

    def __init__(self, policy: Policy, max_seqs: int = 4, max_chunks: int = 4, slots: int = 4,
                 horizon: int = 8, lifecycle: Lifecycle | None = None) -> None:
        if min(max_seqs, max_chunks, slots) < 1:
            raise ValueError("--max-seqs, --max-chunks and --slots must be >= 1")
        self.policy, self.max_seqs, self.max_chunks, self.slots = \
            policy, max_seqs, max_chunks, slots
        self.lifecycle = lifecycle or load_lifecycle()
        self.bounds = Bounds.of(policy, slots, max_chunks, horizon)
        self._caps = self._make_caps(horizon)
        # With the TTFT claim implied, neither ages nor prompt sizes need to be in the state.
        self._checked = replace(self.bounds, ttft_by_chunks=(None,)) if self.ttft_implied \
            else self.bounds

    @property
    def ttft_implied(self) -> bool:
        """A C-chunk prompt is granted C times, each within wait_ticks + 1 ticks of the last
        (or of admission), so a TTFT claim >= C * (wait_ticks + 1) follows from the wait claim
        and needs no age counter (which would multiply the state space)."""
        w = self.bounds.wait_ticks
        return w is not None and all(
            t is not None and t >= c * (w + 1)
            for c, t in enumerate(self.bounds.ttft_by_chunks) if c > 0)

    def _make_caps(self, horizon: int) -> tuple[int, int, int, int, int]:
        b, spec = self.bounds, self.policy.spec
        seen = set().union(*(r.when.names for r in spec.rules), spec.grants.names,
                           spec.chunk_tokens.names)
        finite = [x for x in (b.wait_ticks, b.overtakes, b.decode_wait_ticks,
                              *b.ttft_by_chunks) if x is not None]
        wait = b.wait_ticks + 1 if b.wait_ticks is not None else horizon
        visible = max([wait, *(int(v) + 1 for v in self.policy.params.values()),
                       *(x + 1 for x in finite)])
        ttfts = [t for t in b.ttft_by_chunks if t is not None]
        age = max(ttfts) + 1 if len(ttfts) == len(b.ttft_by_chunks) else 0
        if self.ttft_implied:
            age = 0  # no need to track: the claim follows from the wait bound
        over = b.overtakes + 1 if b.overtakes is not None else 0
        if b.decode_wait_ticks is not None:
            dwait = b.decode_wait_ticks + 1
        else:
            dwait = visible if "decode_wait_ticks" in seen else 0
        streak = visible if "decode_streak" in seen else 0
        return wait, age, over, dwait, streak

    # -- exploration ------------------------------------------------------------------------
    def run(self, time_limit_s: float | None = None) -> Report:
        """Breadth-first search of the whole bounded state space."""
        report = Report(self.policy, self.max_seqs, self.max_chunks, self.slots, self.bounds)
        start = time.perf_counter()
        root = World(())
        parents: dict[World, tuple[World | None, Label | None]] = {root: (None, None)}
        depth = {root: 0}
        queue = deque([root])
        while queue:
            world = queue.popleft()
            for step in self.successors(world):
                report.edges += 1
                for v in step.violations:
                    if v.name not in report.counterexamples:
                        path = self._path(parents, world) + [step.label]
                        report.counterexamples[v.name] = (v, path)
                nxt = step.world
                if nxt not in parents:
                    if step.label[0] == "tick":
                        self._observe(report, nxt)
                    parents[nxt] = (world, step.label)
                    depth[nxt] = depth[world] + 1
                    report.depth = max(report.depth, depth[nxt])
                    queue.append(nxt)
            if time_limit_s is not None and time.perf_counter() - start > time_limit_s:
                raise TimeoutError(f"state space not exhausted after {time_limit_s} s "
                                   f"({len(parents)} states): lower the bounds")
        report.states = len(parents)
        report.seconds = time.perf_counter() - start
        return report

    @staticmethod
    def _path(parents: dict[World, tuple[World | None, Label | None]],
              world: World) -> list[Label]:
        labels: list[Label] = []
        node: World | None = world
        while node is not None:
            node, label = parents[node]
            if label is not None:
                labels.append(label)
        return labels[::-1]

    def _observe(self, report: Report, world: World) -> None:
        seen = report.max_seen
        for s in world.seqs:
            if s.phase == "parked_prefill":
                seen["wait_ticks"] = max(seen.get("wait_ticks", 0), s.wait)
                seen["overtakes"] = max(seen.get("overtakes", 0), s.overtaken)
            if s.phase == "decoding" and s.age:
                seen["ttft_ticks"] = max(seen.get("ttft_ticks", 0), s.age)
        seen["decode_wait_ticks"] = max(seen.get("decode_wait_ticks", 0), world.dwait)

    def canonical(self, world: World) -> World:
        """Renumber ids by arrival order and apply the counter caps."""
        wait, age, over, dwait, streak = self._caps
        implied = self.ttft_implied
        seqs = tuple(SeqRec(i, s.phase, s.prefill_left,
                            0 if implied and s.phase != "waiting" else s.num_chunks,
                            min(s.wait, wait), min(s.age, age), min(s.overtaken, over))
                     for i, s in enumerate(world.seqs))
        has_decoding = any(s.phase == "decoding" for s in seqs)
        return World(seqs, min(world.streak, streak), min(world.dwait, dwait) if has_decoding
                     else 0)

    # -- transitions --------------------------------------------------------------------------
    def successors(self, world: World, stable: bool = False) -> Iterator[Step]:
        """Every environment step and the tick from a canonical `world`, each leading to a
        canonical world (with `stable`, ids are kept instead, for replaying a path)."""
        seqs = world.seqs
        if len(seqs) < self.max_seqs:
            next_id = max((s.seq_id for s in seqs), default=-1) + 1
            for c in range(1, self.max_chunks + 1):
                yield Step(("arrive", c), world._replace(
                    seqs=(*seqs, SeqRec(next_id, "waiting", c, c))), (), ())
        for i, s in enumerate(seqs):
            yield self._leave(world, i, "abort", stable)
            if s.phase == "decoding":
                yield self._leave(world, i, "finish", stable)
        step = self.tick(world)
        yield step if stable else replace(step, world=self.canonical(step.world))

    def _leave(self, world: World, i: int, trigger: str, stable: bool) -> Step:
        s = world.seqs[i]
        events, violations = [], []
        try:
            dest = self.lifecycle.next_state(s.phase, trigger, s)
            events.append((s.seq_id, s.phase, dest, trigger, trigger))
        except ValueError as exc:
            violations.append(Violation("lifecycle", str(exc), s.seq_id))
        rest = world.seqs[:i] + world.seqs[i + 1:]
        if not stable:
            rest = rest[:i] + tuple(SeqRec(r[0] - 1, *r[1:]) for r in rest[i:])
        after = world._replace(seqs=rest)
        if after.dwait and not any(r.phase == "decoding" for r in rest):
            after = after._replace(dwait=0)
        return Step((trigger, i), after, tuple(events), tuple(violations))

    def tick(self, world: World) -> Step:
        """Admit, decide with the real `decide_tick`, apply, check."""
        events: list[tuple[int, str, str, str, str]] = []
        violations: list[Violation] = []

        def fire(s: SeqRec, trigger: str, rule: str) -> SeqRec:
            try:
                dest = self.lifecycle.next_state(s.phase, trigger, s)
            except ValueError as exc:
                violations.append(Violation("lifecycle", str(exc), s.seq_id))
                return s
            events.append((s.seq_id, s.phase, dest, trigger, rule))
            return SeqRec(s[0], dest, *s[2:])

        seqs = list(world.seqs)
        holding = sum(s.phase in self.lifecycle.slot_states for s in seqs)
        for i, s in enumerate(seqs):
            if s.phase == "waiting" and holding < self.slots:
                s = fire(s, "admit", "admit")
                seqs[i] = SeqRec(s[0], s[1], s[2], s[3])  # counters start at 0
                holding += 1
        state = self._tick_state(seqs, world)
        decision = decide_tick(state, self.policy)
        violations += check_decision(state, decision)
        parked = {p.seq_id: p for p in state.parked}
        completed = []
        for i, s in enumerate(seqs):
            if s.seq_id in parked:
                s = SeqRec(s[0], s[1], s[2], s[3], *parked_after_tick(parked[s.seq_id], decision))
            if s.seq_id in decision.granted and s.phase == "parked_prefill":
                s = fire(s, "grant", decision.rule)
                left = s.prefill_left - min(decision.chunk_tokens, s.prefill_left)
                s = fire(SeqRec(s[0], s[1], left, *s[3:]), "chunk_done", decision.rule)
                if s.phase == "decoding":
                    completed.append((s.seq_id, s.age, s.num_chunks))
            seqs[i] = s
        after = World(tuple(seqs), decision.memory.decode_streak,
                      decode_wait_after_tick(state, decision))
        violations += check_slots(sum(s.phase in self.lifecycle.slot_states for s in seqs),
                                  self.slots)
        violations += check_claims(self._tick_state(seqs, after), self._checked,
                                   tuple(completed))
        granted = f" granted {list(decision.granted)}" if decision.granted else ""
        note = f"{decision.action} (rule {decision.rule}){granted}"
        return Step(("tick", 0), after, tuple(events), tuple(violations), note)

    def _tick_state(self, seqs: list[SeqRec], world: World) -> TickState:
        parked = tuple(ParkedPrefill(s.seq_id, s.wait, s.prefill_left, s.num_chunks, s.age,
                                     s.overtaken) for s in seqs if s.phase == "parked_prefill")
        num_decoding = sum(s.phase == "decoding" for s in seqs)
        return TickState(self.slots, sum(s.phase == "waiting" for s in seqs), num_decoding,
                         parked, world.dwait if num_decoding else 0, 1, None,
                         PolicyMemory(world.streak))

    # -- counterexamples ------------------------------------------------------------------------
    def replay(self, labels: list[Label]) -> list[tuple[str, list[dict[str, Any]]]]:
        """Re-run `labels` with stable sequence ids: each step's description and trace events."""
        world, tick = World(()), 0
        out: list[tuple[str, list[dict[str, Any]]]] = []
        for label in labels:
            step = next(s for s in self.successors(world, stable=True) if s.label == label)
            kind, arg = label
            if kind == "arrive":
                text = f"seq {step.world.seqs[-1].seq_id} arrives ({arg} chunks)"
            elif kind == "tick":
                text = f"tick {tick}: {step.note}"
                tick += 1
            else:
                text = f"seq {world.seqs[arg].seq_id} {kind}s"
            events = [{"tick": tick - (kind == "tick"), "time": None, "seq": e[0], "from": e[1],
                       "to": e[2], "trigger": e[3], "rule": e[4]} for e in step.events]
            out.append((text, events))
            world = step.world
        return out

    def lasso(self, labels: list[Label], seq_index: int) -> tuple[int, int] | None:
        """Steps (i, j) after which the lifecycle states (phases and prompt left of every
        sequence) are equal and between which the sequence at `seq_index` in the final state
        is never granted: the ticks i+1..j can repeat forever. None if the path has none."""
        world, granted = World(()), set()
        seen: dict[tuple[Any, ...], list[tuple[int, frozenset[int]]]] = {}
        for n, label in enumerate(labels):
            step = next(s for s in self.successors(world, stable=True) if s.label == label)
            world = step.world
            granted |= {e[0] for e in step.events if e[3] == "grant"}
            key = (tuple((s.seq_id, s.phase, s.prefill_left) for s in world.seqs), world.streak > 0)
            seen.setdefault(key, []).append((n, frozenset(granted)))
        if seq_index >= len(world.seqs):
            return None
        target = world.seqs[seq_index].seq_id
        for hits in seen.values():
            for (i, g_i), (j, g_j) in zip(hits, hits[1:], strict=False):
                if target not in (g_j - g_i) and any(s.seq_id == target for s in world.seqs):
                    return i + 1, j + 1
        return None


CLAIM_ORDER = (*CLAIMS, *UNIVERSAL)
