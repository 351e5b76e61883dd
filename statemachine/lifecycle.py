"""The per-sequence lifecycle: specs/lifecycle.yaml, the one place that names states.

The code speaks in roles (`Role`) and triggers (`Trigger`); the spec gives each role a state
name and declares the edges, which must be exactly the role edges the code handles
(`ROLE_EDGES`). A spec with an unknown role, a missing or extra edge, or a guard no code
evaluates is refused at load. A renamed state changes nothing but the trace's words.
`Lifecycle.move` answers which role a trigger leads to (for the step function); `make_machine`
compiles the edges into one `transitions` Machine (the scheduler's record of each sequence).
"""

from __future__ import annotations

import enum
import functools
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transitions import Machine

from statemachine.yamlsrc import Path_, Source, SpecError, load_source

logging.getLogger("transitions").setLevel(logging.WARNING)  # DEBUG costs ~10x per trigger

DEFAULT_LIFECYCLE = Path(__file__).resolve().parent.parent / "specs" / "lifecycle.yaml"


class Role(enum.IntEnum):
    """What a state means to the code."""

    QUEUED = 0  # arrived, holds nothing
    PARKED = 1  # holds KV; prompt tokens left; waits for a grant
    PREFILLING = 2  # a prompt slice runs in this tick
    DECODING = 3  # one token per decoding tick
    PAUSED = 4  # preempted, KV kept
    PREEMPTED = 5  # preempted, KV dropped: re-prefilled when readmitted
    FINISHED = 6
    ABORTED = 7

    @property
    def word(self) -> str:
        return self.name.lower()

    @property
    def holds_kv(self) -> bool:
        """Counts against the KV budget and the running limit."""
        return self in KV_ROLES

    @property
    def terminal(self) -> bool:
        return self in (Role.FINISHED, Role.ABORTED)


KV_ROLES = frozenset({Role.PARKED, Role.PREFILLING, Role.DECODING, Role.PAUSED})


class Trigger(str, enum.Enum):
    """The events the code fires."""

    ADMIT = "admit"
    GRANT = "grant"
    CHUNK_DONE = "chunk_done"
    FINISH = "finish"
    PAUSE = "pause"
    RESUME = "resume"
    PREEMPT = "preempt"
    READMIT = "readmit"
    ABORT = "abort"
    FORK = "fork"


HAS_PREFILL_LEFT = "has_prefill_left"  # the one guard; a predicate of the sequence record
GUARDS = (HAS_PREFILL_LEFT,)
REQUIRED_ROLES = (Role.QUEUED, Role.PARKED, Role.PREFILLING, Role.DECODING, Role.FINISHED,
                  Role.ABORTED)
_LIVE = tuple(r for r in Role if not r.terminal)

# (trigger, source role, dest role) -> (conditions, unless): every edge the code can fire.
ROLE_EDGES: dict[tuple[Trigger, Role, Role], tuple[tuple[str, ...], tuple[str, ...]]] = {
    (Trigger.ADMIT, Role.QUEUED, Role.PARKED): ((), ()),
    (Trigger.GRANT, Role.PARKED, Role.PREFILLING): ((), ()),
    (Trigger.CHUNK_DONE, Role.PREFILLING, Role.PARKED): ((HAS_PREFILL_LEFT,), ()),
    (Trigger.CHUNK_DONE, Role.PREFILLING, Role.DECODING): ((), (HAS_PREFILL_LEFT,)),
    (Trigger.FINISH, Role.DECODING, Role.FINISHED): ((), ()),
    (Trigger.PAUSE, Role.DECODING, Role.PAUSED): ((), ()),
    (Trigger.RESUME, Role.PAUSED, Role.DECODING): ((), ()),
    (Trigger.PREEMPT, Role.PARKED, Role.PREEMPTED): ((), ()),
    (Trigger.PREEMPT, Role.DECODING, Role.PREEMPTED): ((), ()),
    (Trigger.PREEMPT, Role.PAUSED, Role.PREEMPTED): ((), ()),
    (Trigger.READMIT, Role.PREEMPTED, Role.PARKED): ((), ()),
    # A sibling choice (`n` > 1) born on a copy of its prompt's KV, with its first token.
    (Trigger.FORK, Role.QUEUED, Role.DECODING): ((), ()),
    **{(Trigger.ABORT, r, Role.ABORTED): ((), ()) for r in _LIVE},
}

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


@dataclass(frozen=True)
class Edge:
    """One declared transition, by state names."""

    trigger: Trigger
    source: str
    dest: str
    conditions: tuple[str, ...] = ()
    unless: tuple[str, ...] = ()


@dataclass(frozen=True)
class Lifecycle:
    """A validated lifecycle spec: a state name per role, and the edges."""

    file: str
    state_of: Mapping[Role, str]
    docs: Mapping[str, str]
    edges: tuple[Edge, ...]

    @functools.cached_property
    def role_of(self) -> Mapping[str, Role]:
        return {name: role for role, name in self.state_of.items()}

    @property
    def initial(self) -> str:
        return self.state_of[Role.QUEUED]

    def has(self, role: Role) -> bool:
        return role in self.state_of

    def require(self, roles: tuple[Role, ...], why: str) -> None:
        """ValueError naming the roles this lifecycle lacks for `why`."""
        missing = [r.word for r in roles if r not in self.state_of]
        if missing:
            raise ValueError(f"{self.file}: {why} needs a state with role "
                             f"{' and '.join(missing)}; declare it with its edges")

    def move(self, role: Role, trigger: Trigger, rec: Any) -> Role:
        """The role `trigger` takes a sequence in `role` to; guards read `rec`. ValueError if
        the lifecycle has no such edge."""
        for conditions, unless, dest in self._table.get((role, trigger), ()):
            if all(getattr(rec, g)() for g in conditions) and \
                    not any(getattr(rec, g)() for g in unless):
                return Role(dest)
        raise ValueError(f"illegal transition: {trigger.value!r} from "
                         f"{self.state_of.get(role, role.word)!r} is not in {self.file}")

    @functools.cached_property
    def _table(self) -> Mapping[tuple[Role, Trigger], tuple[tuple[Any, ...], ...]]:
        table: dict[tuple[Role, Trigger], tuple[tuple[Any, ...], ...]] = {}
        for e in self.edges:
            key = (self.role_of[e.source], e.trigger)
            table[key] = (*table.get(key, ()), (e.conditions, e.unless, self.role_of[e.dest]))
        return table

    def make_machine(self) -> Machine:
        """One shared Machine; sequences join with `add_model` and leave with `remove_model`."""
        return Machine(
            model=None, states=list(self.role_of), initial=self.initial,
            auto_transitions=False, send_event=False, ignore_invalid_triggers=False,
            transitions=[{"trigger": e.trigger.value, "source": e.source, "dest": e.dest,
                          "conditions": list(e.conditions), "unless": list(e.unless)}
                         for e in self.edges],
        )


@functools.lru_cache(maxsize=8)
def load_lifecycle(path: str | Path | None = None) -> Lifecycle:
    """Load and validate a lifecycle spec (default: specs/lifecycle.yaml)."""
    src = load_source(path or DEFAULT_LIFECYCLE)
    doc = src.data
    if not isinstance(doc, dict):
        raise src.error((), "a lifecycle spec is a mapping with states, guards, transitions")
    for key in doc:
        if key not in ("states", "guards", "transitions"):
            raise src.error((key,), "unknown field; allowed: guards, states, transitions")
    state_of, docs = _states(src, doc.get("states"))
    guards = doc.get("guards") or {}
    if not isinstance(guards, dict):
        raise src.error(("guards",), "must map each guard name to a one-line description")
    for g in guards:
        if g not in GUARDS:
            raise src.error(("guards", g), f"no code evaluates guard {g!r}; known: "
                            f"{', '.join(GUARDS)}")
    role_of = {name: role for role, name in state_of.items()}
    edges = _edges(src, doc.get("transitions"), role_of, set(guards))
    _check_complete(src, state_of, role_of, edges)
    return Lifecycle(src.file, state_of, docs, edges)


def _states(src: Source, raw: Any) -> tuple[dict[Role, str], dict[str, str]]:
    if not isinstance(raw, dict) or not raw:
        raise src.error(("states",), "must map each state name to {role, doc}")
    roles = ", ".join(r.word for r in Role)
    state_of: dict[Role, str] = {}
    docs: dict[str, str] = {}
    for name, body in raw.items():
        path: Path_ = ("states", name)
        if not _NAME.match(name):
            raise src.error(path, "state names are lower_snake_case, at most 64 characters")
        if not isinstance(body, dict) or "role" not in body:
            raise src.error(path, f"must be {{role: ..., doc: ...}}; roles: {roles}")
        for key in body:
            if key not in ("role", "doc"):
                raise src.error((*path, key), "unknown field; allowed: doc, role")
        word = body["role"]
        role = next((r for r in Role if r.word == word), None)
        if role is None:
            raise src.error((*path, "role"), f"no code handles role {word!r}; roles: {roles}")
        if role in state_of:
            raise src.error((*path, "role"), f"role {word} is already the role of state "
                            f"{state_of[role]!r}; each role names one state")
        state_of[role] = name
        docs[name] = str(body.get("doc", "")).strip()
    missing = [r.word for r in REQUIRED_ROLES if r not in state_of]
    if missing:
        raise src.error(("states",), f"no state has role {', '.join(missing)}; every "
                        f"lifecycle needs {', '.join(r.word for r in REQUIRED_ROLES)}")
    return state_of, docs


def _edges(src: Source, raw: Any, role_of: dict[str, Role], guards: set[str]) -> tuple[Edge, ...]:
    if not isinstance(raw, list) or not raw:
        raise src.error(("transitions",), "must be a list of {trigger, source, dest}")
    triggers = {t.value: t for t in Trigger}
    edges: list[Edge] = []
    for i, t in enumerate(raw):
        path: Path_ = ("transitions", i)
        if not isinstance(t, dict):
            raise src.error(path, "each transition is {trigger, source, dest}")
        unknown = set(t) - {"trigger", "source", "dest", "conditions", "unless"}
        if unknown:
            raise src.error((*path, sorted(unknown)[0]), "unknown field; allowed: conditions, "
                            "dest, source, trigger, unless")
        trigger = triggers.get(t.get("trigger"))  # type: ignore[arg-type]
        if trigger is None:
            raise src.error((*path, "trigger"), f"no code fires trigger {t.get('trigger')!r}; "
                            f"triggers: {', '.join(triggers)}")
        raw_source = t.get("source")
        sources: list[Any] = raw_source if isinstance(raw_source, list) else [raw_source]
        dest = _state(src, (*path, "dest"), t.get("dest"), role_of)
        guard = tuple(_guards(src, (*path, k), t.get(k), guards) for k in ("conditions",
                                                                          "unless"))
        for j, s in enumerate(sources):
            source = _state(src, (*path, "source", j), s, role_of)
            key = (trigger, role_of[source], role_of[dest])
            if key not in ROLE_EDGES:
                raise src.error(path, f"{trigger.value!r} from {source!r} (role "
                                f"{key[1].word}) to {dest!r} (role {key[2].word}) is not an "
                                f"edge the code fires; {trigger.value!r} goes "
                                f"{_edge_words(trigger)}")
            if guard != ROLE_EDGES[key]:
                want = ROLE_EDGES[key]
                raise src.error(path, f"{trigger.value!r} from {source!r} to {dest!r} must "
                                f"have conditions {list(want[0])} and unless {list(want[1])}")
            if any((e.trigger, e.source, e.dest) == (trigger, source, dest) for e in edges):
                raise src.error(path, f"{trigger.value!r} from {source!r} to {dest!r} is "
                                "declared twice")
            edges.append(Edge(trigger, source, dest, *guard))
    return tuple(edges)


def _edge_words(trigger: Trigger) -> str:
    return ", ".join(f"{s.word} -> {d.word}" for (t, s, d) in ROLE_EDGES if t == trigger)


def _state(src: Source, path: Path_, value: Any, role_of: dict[str, Role]) -> str:
    if not isinstance(value, str) or value not in role_of:
        raise src.error(path, f"unknown state {value!r}; declared: {', '.join(role_of)}")
    return value


def _guards(src: Source, path: Path_, value: Any, guards: set[str]) -> tuple[str, ...]:
    items = [] if value is None else value if isinstance(value, list) else [value]
    for g in items:
        if g not in guards:
            raise src.error(path, f"guard {g!r} is not declared under guards:")
    return tuple(items)


def _check_complete(src: Source, state_of: dict[Role, str], role_of: dict[str, Role],
                    edges: tuple[Edge, ...]) -> None:
    declared = {(e.trigger, role_of[e.source], role_of[e.dest]) for e in edges}
    for trigger, s, d in ROLE_EDGES:
        if s in state_of and d in state_of and (trigger, s, d) not in declared:
            raise SpecError(src.file, src.line(("transitions",)), "transitions",
                            f"missing {trigger.value!r} from {state_of[s]!r} to "
                            f"{state_of[d]!r}: the code fires it for role {s.word}")
