"""The per-sequence lifecycle: specs/lifecycle.yaml compiled into one `transitions` Machine.

The compiler rejects unknown states, unreachable states, live states with no way out, guard
names it cannot bind, and ambiguous triggers. `Lifecycle.next_state` answers the same question
the machine does (which edge a trigger takes) without a model, for the exhaustive checker.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transitions import Machine

from statemachine.sequence import Sequence
from statemachine.spec import SPECS_DIR
from statemachine.yamlsrc import Source, SpecError, load_source

logging.getLogger("transitions").setLevel(logging.WARNING)  # DEBUG costs ~10x per trigger



def _guard(seq: Any, name: str) -> bool:
    return bool(getattr(seq, name)())


@dataclass(frozen=True)
class Edge:
    """One declared transition."""

    trigger: str
    source: str
    dest: str
    conditions: tuple[str, ...] = ()
    unless: tuple[str, ...] = ()

    def allows(self, seq: Any) -> bool:
        return all(_guard(seq, g) for g in self.conditions) and \
            not any(_guard(seq, g) for g in self.unless)


@dataclass(frozen=True)
class Lifecycle:
    """A validated lifecycle spec."""

    file: str
    states: tuple[str, ...]
    initial: str
    terminal: frozenset[str]
    slot_states: frozenset[str]
    edges: tuple[Edge, ...]

    def next_state(self, source: str, trigger: str, seq: Any) -> str:
        """The state `trigger` takes `seq` to from `source`; ValueError if no edge allows it."""
        edges = self._by_key.get((source, trigger), ())
        if len(edges) == 1 and not edges[0].conditions and not edges[0].unless:
            return edges[0].dest  # the common case: one unguarded edge
        for edge in edges:
            if edge.allows(seq):
                return edge.dest
        raise ValueError(f"illegal transition: {trigger!r} from {source!r} is not in {self.file}")

    @functools.cached_property
    def _by_key(self) -> Mapping[tuple[str, str], tuple[Edge, ...]]:
        table: dict[tuple[str, str], tuple[Edge, ...]] = {}
        for e in self.edges:
            table[(e.source, e.trigger)] = (*table.get((e.source, e.trigger), ()), e)
        return table

    def make_machine(self) -> Machine:
        """One shared Machine; sequences join with `add_model` and leave with `remove_model`."""
        return Machine(
            model=None, states=list(self.states), initial=self.initial,
            auto_transitions=False, send_event=False, ignore_invalid_triggers=False,
            transitions=[{"trigger": e.trigger, "source": e.source, "dest": e.dest,
                          "conditions": list(e.conditions), "unless": list(e.unless)}
                         for e in self.edges],
        )


@functools.lru_cache(maxsize=8)
def load_lifecycle(path: str | Path | None = None, model: type = Sequence) -> Lifecycle:
    """Load and validate a lifecycle spec (default: specs/lifecycle.yaml); guards are bound
    to predicate methods of `model`, the sequence class."""
    src = load_source(path or SPECS_DIR / "lifecycle.yaml")
    doc = src.data
    if not isinstance(doc, dict):
        raise src.error((), "a lifecycle spec is a mapping with states, transitions, ...")
    allowed = {"initial", "terminal", "slot_states", "states", "guards", "transitions"}
    for key in doc:
        if key not in allowed:
            raise src.error((key,), f"unknown field; allowed: {', '.join(sorted(allowed))}")
    states = doc.get("states")
    if not isinstance(states, dict) or not states:
        raise src.error(("states",), "must map each state name to a one-line description")
    names = tuple(states)
    initial = _state(src, ("initial",), doc.get("initial"), names)
    terminal = _state_list(src, "terminal", doc.get("terminal", []), names)
    slot_states = _state_list(src, "slot_states", doc.get("slot_states", []), names)
    guards = doc.get("guards") or {}
    for g in guards:
        if not callable(getattr(model, g, None)):
            raise src.error(("guards", g), f"cannot bind guard {g!r}: {model.__name__} has "
                            "no such predicate method")
    edges = _edges(src, doc.get("transitions"), names, set(guards))
    life = Lifecycle(src.file, names, initial, frozenset(terminal), frozenset(slot_states), edges)
    _check_graph(src, life)
    return life


def _state(src: Source, path: tuple[str | int, ...], value: Any, names: tuple[str, ...]) -> str:
    if value not in names:
        raise src.error(path, f"unknown state {value!r}; declared: {', '.join(names)}")
    return str(value)


def _state_list(src: Source, key: str, value: Any, names: tuple[str, ...]) -> list[str]:
    items = value if isinstance(value, list) else [value]
    return [_state(src, (key, i), v, names) for i, v in enumerate(items)]


def _edges(src: Source, raw: Any, names: tuple[str, ...], guards: set[str]) -> tuple[Edge, ...]:
    if not isinstance(raw, list) or not raw:
        raise src.error(("transitions",), "must be a list of {trigger, source, dest}")
    edges: list[Edge] = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or "trigger" not in t:
            raise src.error(("transitions", i), "each transition needs trigger, source, dest")
        unknown = set(t) - {"trigger", "source", "dest", "conditions", "unless"}
        if unknown:
            raise src.error(("transitions", i, sorted(unknown)[0]), "unknown field")
        sources = _state_list(src, "transitions", t.get("source"), names)
        dest = _state(src, ("transitions", i, "dest"), t.get("dest"), names)
        conds = {k: tuple(t.get(k) or ()) for k in ("conditions", "unless")}
        for key, gs in conds.items():
            for g in gs:
                if g not in guards:
                    raise src.error(("transitions", i, key), f"guard {g!r} is not declared "
                                    f"under guards: or cannot be bound")
        for s in sources:
            edge = Edge(str(t["trigger"]), s, dest, conds["conditions"], conds["unless"])
            for other in edges:
                if (other.source, other.trigger) == (s, edge.trigger) and \
                        not _distinguished(other, edge):
                    raise src.error(("transitions", i), f"trigger {edge.trigger!r} from {s!r} "
                                    "is declared twice without guards that tell them apart")
            edges.append(edge)
    return tuple(edges)


def _distinguished(a: Edge, b: Edge) -> bool:
    # Two edges on the same trigger are distinguishable when one requires a guard the other forbids.
    return bool(set(a.conditions) & set(b.unless) or set(a.unless) & set(b.conditions))


def _check_graph(src: Source, life: Lifecycle) -> None:
    reach, frontier = {life.initial}, [life.initial]
    while frontier:
        state = frontier.pop()
        for e in life.edges:
            if e.source == state and e.dest not in reach:
                reach.add(e.dest)
                frontier.append(e.dest)
    for state in life.states:
        if state not in reach:
            raise src.error(("states", state), f"unreachable from {life.initial!r}")
        has_exit = any(e.source == state for e in life.edges)
        if state not in life.terminal and not has_exit:
            raise src.error(("states", state), "not terminal, but no transition leaves it")
        if state in life.terminal and has_exit:
            raise src.error(("states", state), "terminal, but a transition leaves it")
    for edge in life.edges:
        if edge.source in life.terminal:
            raise SpecError(src.file, src.line(("transitions",)), "transitions",
                            f"{edge.trigger!r} leaves terminal state {edge.source!r}")
