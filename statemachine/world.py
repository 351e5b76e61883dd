"""The one step function: how a tick, an abort and a finish change the sequences.

The scheduler core (over its `transitions` models), the exhaustive checker (over tuples) and
the Hypothesis machine (through the scheduler) all call these functions, so the checker
explores exactly what runs. A tick is two calls around the executor:

1. `begin_tick` makes KV room for the tick's decode tokens (the youngest running sequences
   pause or are preempted, as the policy's `kv_full` says), admits queued and preempted
   sequences in arrival order while they fit, asks `decide_tick`, and grants.
2. `end_tick` applies what ran: prefill slices done (the last one yields a token), one token
   per decoding row, sequences at their max_tokens finished, and every counter moved.

`leave` is an abort or a finish between ticks. Sequences are `Seq` records in arrival order.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import NamedTuple

from statemachine.lifecycle import KV_ROLES, Lifecycle, Role, Trigger
from statemachine.tick import Decision, ParkedPrefill, Policy, PolicyMemory, TickState, decide_tick


class Seq(NamedTuple):
    """One sequence: its role, its token counts and its counters (all per tick)."""

    seq_id: int  # arrival order
    role: Role
    prompt_len: int
    max_tokens: int | None  # None: no limit
    target: int  # tokens this admission prefills: the prompt, plus the output after a recompute
    prefilled: int = 0  # of `target`, in the KV cache
    generated: int = 0
    wait: int = 0  # ticks parked since admission or the last grant
    overtaken: int = 0  # grants others got since then
    queue: int = 0  # ticks queued (or preempted) since arrival or the last preemption
    age: int = 0  # ticks since arrival, until the first token
    grants: int = 0  # grants before the first token
    preemptions: int = 0
    observed: bool = True  # the checker tracks claim counters of one observed sequence only

    def has_prefill_left(self) -> bool:
        """Guard: tokens it must prefill are not all in its KV cache yet."""
        return self.prefilled < self.target

    @property
    def kv_cached(self) -> int:
        """Tokens in its KV cache (the newest sampled token is written by the next step)."""
        if self.role not in KV_ROLES:
            return 0
        return self.prefilled + max(0, self.generated - (self.target - self.prompt_len) - 1)

    def kv_reserved(self, kv_full: str) -> int:
        """Tokens of the KV budget it holds: under `queue` its prompt and every token it may
        generate; otherwise its prompt, what it has generated, and the token its prefill will
        yield (so that finishing a prefill never needs room that is not there)."""
        if kv_full == "queue":
            assert self.max_tokens is not None, "a KV budget under kv_full: queue needs it"
            return self.prompt_len + self.max_tokens
        return self.prompt_len + self.generated + (self.prefilled < self.target)


def admissible(prompt_len: int, max_tokens: int | None, kv_budget: int | None) -> str | None:
    """Why a request could never run under `kv_budget`, or None if it can (alone it must fit:
    then the oldest sequence can always finish, whatever else is queued)."""
    if prompt_len < 1:
        return f"a prompt needs at least one token, got {prompt_len}"
    if max_tokens is not None and max_tokens < 1:
        return f"max_tokens must be >= 1, got {max_tokens}"
    if kv_budget is not None and (max_tokens is None or prompt_len + max_tokens > kv_budget):
        return (f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) must fit the KV "
                f"budget of {kv_budget} tokens")
    return None


def new_seq(seq_id: int, prompt_len: int, max_tokens: int | None) -> Seq:
    """A sequence that just arrived (role queued)."""
    return Seq(seq_id, Role.QUEUED, prompt_len, max_tokens, prompt_len)


class World(NamedTuple):
    """The sequences (arrival order) and what the scheduler carries between ticks."""

    seqs: tuple[Seq, ...] = ()
    streak: int = 0  # the policy memory: decode ticks in a row while a prompt was parked
    dwait: int = 0  # ticks the decoding sequences have gone without a step


@dataclass(frozen=True)
class Layout:
    """The configuration a scheduler runs (and the checker explores)."""

    max_running: int  # sequences holding KV at once
    chunk_size: int  # prompt tokens per prefill chunk
    kv_budget: int | None = None  # tokens of KV; None: unlimited

    def __post_init__(self) -> None:
        for name in ("max_running", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_budget is not None and self.kv_budget < 1:
            raise ValueError(f"kv_budget must be >= 1 or None, got {self.kv_budget}")


class Event(NamedTuple):
    """A lifecycle change: `seq_id` went from role `src` to `dst` by `trigger`; `rec` is the
    record its guards read (the change's new counts, the old role)."""

    seq_id: int
    trigger: Trigger
    src: Role
    dst: Role
    rule: str
    rec: Seq


@dataclass(frozen=True)
class PrefillWork:
    """Run the next `num_tokens` tokens of `seq_id`'s prefill."""

    seq_id: int
    num_tokens: int


@dataclass(frozen=True)
class Plan:
    """A tick decided: the world after admission and grants, and what the executor runs."""

    world: World
    state: TickState
    decision: Decision
    prefills: tuple[PrefillWork, ...]
    decode: tuple[int, ...]
    events: tuple[Event, ...]

    @property
    def dropped(self) -> tuple[int, ...]:
        """Sequences preempted in this tick: their KV caches must be freed."""
        return tuple(e.seq_id for e in self.events if e.trigger is Trigger.PREEMPT)


@dataclass(frozen=True)
class Outcome:
    """A tick applied: the next world, its events, the prompts whose first token came in it
    as (seq, age, grants), and the first grants in it as (seq, age)."""

    world: World
    events: tuple[Event, ...]
    completed: tuple[tuple[int, int, int], ...]
    first_grants: tuple[tuple[int, int], ...]


Budget = Callable[[TickState], int]


def begin_tick(world: World, policy: Policy, life: Lifecycle, layout: Layout,
               budget: Budget | None = None,
               decide: Callable[[TickState, Policy], Decision] = decide_tick) -> Plan:
    """Make KV room, admit, decide and grant. `budget` gives the prefill tokens that fit the
    tick's latency target; it is asked only in a contended tick of a policy that has one.
    `decide` is `decide_tick` (the checker passes it remembered)."""
    seqs, events = list(world.seqs), list[Event]()
    kv_full, budget_kv = policy.spec.kv_full, layout.kv_budget
    counts, committed = _census(seqs, kv_full)
    waiting = counts[Role.QUEUED] + counts[Role.PREEMPTED]
    if budget_kv is not None and kv_full != "queue" and \
            (committed + counts[Role.DECODING] > budget_kv or counts[Role.PAUSED]):
        _make_room(seqs, kv_full, budget_kv, life, events)
    if waiting:
        _admit(seqs, kv_full, layout, life, events)
    state = tick_state(seqs, world, layout)
    if budget is not None and state.parked and state.num_decoding and \
            policy.spec.tick_budget_ms is not None:
        state = state._replace(budget_tokens=budget(state))
    decision = decide(state, policy)
    where = {s.seq_id: i for i, s in enumerate(seqs)} if decision.granted else {}
    prefills = []
    for seq_id in decision.granted:
        s = seqs[where[seq_id]]
        left = s.target - s.prefilled
        _fire(seqs, where[seq_id], Trigger.GRANT, decision.rule, life, events,
              grants=s.grants + 1)
        prefills.append(PrefillWork(seq_id, min(decision.chunk_tokens, left)))
    decode = tuple(s.seq_id for s in seqs if s.role is Role.DECODING) \
        if decision.decodes else ()
    return Plan(World(tuple(seqs), world.streak, world.dwait), state, decision,
                tuple(prefills), decode, tuple(events))


def end_tick(plan: Plan, life: Lifecycle) -> Outcome:
    """Apply what `plan` ran (sequences that left since `begin_tick` are skipped)."""
    decision, rule = plan.decision, plan.decision.rule
    slices = {w.seq_id: w.num_tokens for w in plan.prefills}
    decoded = set(plan.decode)
    parked = {p.seq_id for p in plan.state.parked}
    num_granted = len(decision.granted)
    seqs, events = list[Seq](), list[Event]()
    completed, first_grants, done_ids = [], [], []
    for s in plan.world.seqs:  # one pass: this runs for every sequence of every tick
        role, generated = s.role, s.generated
        if s.seq_id in slices:
            done = s._replace(prefilled=s.prefilled + slices[s.seq_id])
            role = life.move(role, Trigger.CHUNK_DONE, done)
            events.append(Event(s.seq_id, Trigger.CHUNK_DONE, s.role, role, rule, done))
            if role is Role.DECODING:  # the prompt is in: its logits gave a token
                generated += 1
                if s.generated == 0:
                    completed.append((s.seq_id, s.age + 1, s.grants))
            if s.grants == 1:
                first_grants.append((s.seq_id, s.age + 1))
            s = done
        elif s.seq_id in decoded and role is Role.DECODING:
            generated += 1
        if role is Role.DECODING and s.max_tokens is not None and generated >= s.max_tokens:
            done_ids.append(s.seq_id)  # it has all the tokens it may have
        seqs.append(_count(s, role, generated, s.seq_id in parked, s.seq_id in slices,
                           num_granted))
    stalled = plan.state.num_decoding > 0 and not decision.decodes
    after = World(tuple(seqs), decision.memory.decode_streak,
                  plan.world.dwait + 1 if stalled else 0)
    for seq_id in done_ids:
        after, event = leave(after, seq_id, Trigger.FINISH, life, rule)
        events.append(event)
    return Outcome(after, tuple(events), tuple(completed), tuple(first_grants))


def leave(world: World, seq_id: int, trigger: Trigger, life: Lifecycle,
          rule: str | None = None) -> tuple[World, Event]:
    """An abort (any live sequence) or a finish (a decoding one): it leaves the world."""
    i = next(i for i, s in enumerate(world.seqs) if s.seq_id == seq_id)
    s = world.seqs[i]
    event = Event(seq_id, trigger, s.role, life.move(s.role, trigger, s), rule or trigger.value,
                  s)
    seqs = world.seqs[:i] + world.seqs[i + 1:]
    decoding = any(r.role is Role.DECODING for r in seqs)
    return World(seqs, world.streak, world.dwait if decoding else 0), event


def tick_state(seqs: Collection[Seq], world: World, layout: Layout) -> TickState:
    """The flattened snapshot a policy decides on."""
    chunk = layout.chunk_size
    parked, counts = [], [0] * len(Role)
    for s in seqs:
        counts[s.role] += 1
        if s.role is Role.PARKED:
            parked.append(ParkedPrefill(s.seq_id, s.wait, -(-(s.target - s.prefilled) // chunk)))
    running = counts[Role.PARKED] + counts[Role.PREFILLING] + counts[Role.DECODING] + \
        counts[Role.PAUSED]
    decoding = counts[Role.DECODING]
    return TickState(layout.max_running, running, counts[Role.QUEUED] + counts[Role.PREEMPTED],
                     decoding, counts[Role.PAUSED], tuple(parked),
                     world.dwait if decoding else 0, chunk, None, PolicyMemory(world.streak))


def kv_cached(seqs: Collection[Seq]) -> int:
    """Tokens in the KV caches of all sequences."""
    return sum(s.kv_cached for s in seqs)


# -- internals ---------------------------------------------------------------------------------
def _fire(seqs: list[Seq], i: int, trigger: Trigger, rule: str, life: Lifecycle,
          events: list[Event], **changes: int) -> None:
    s = seqs[i]._replace(**changes)  # type: ignore[arg-type]
    dst = life.move(s.role, trigger, s)
    events.append(Event(s.seq_id, trigger, s.role, dst, rule, s))
    seqs[i] = s._replace(role=dst)


def _count(s: Seq, role: Role, generated: int, was_parked: bool, was_granted: bool,
           num_granted: int) -> Seq:
    # Positional construction: this runs for every sequence of every tick.
    wait, overtaken, queue, age = s[7], s[8], s[9], s[10]
    if was_granted:
        wait, overtaken = 0, 0
    elif was_parked:
        wait, overtaken = wait + 1, overtaken + num_granted
    elif role is Role.QUEUED or role is Role.PREEMPTED:
        queue += 1
    if generated == 0:
        age += 1
    return Seq(s[0], role, s[2], s[3], s[4], s[5], generated, wait, overtaken, queue, age, s[11],
               s[12], s[13])


def _census(seqs: list[Seq], kv_full: str) -> tuple[list[int], int]:
    # How many sequences have each role, and the KV tokens those holding KV have reserved.
    counts, committed = [0] * len(Role), 0
    for s in seqs:
        counts[s.role] += 1
        if s.role in KV_ROLES:
            committed += s.kv_reserved(kv_full)
    return counts, committed


def _committed(seqs: list[Seq], kv_full: str) -> int:
    return sum(s.kv_reserved(kv_full) for s in seqs if s.role in KV_ROLES)


def _make_room(seqs: list[Seq], kv_full: str, budget: int, life: Lifecycle,
               events: list[Event]) -> None:
    # Every decoding row writes one more token this tick: make room for them, youngest first.
    # Under pause, paused sequences resume (oldest first) when their next token fits.
    rule = "kv_full"
    while True:
        if kv_full == "pause":
            _resume(seqs, budget, life, events)
        decoding = sum(s.role is Role.DECODING for s in seqs)
        while _committed(seqs, kv_full) + decoding > budget:
            i = _youngest(seqs, (Role.DECODING,) if kv_full == "pause" and decoding else None)
            if seqs[i].role is Role.DECODING and kv_full == "pause":
                _fire(seqs, i, Trigger.PAUSE, rule, life, events,
                      preemptions=seqs[i].preemptions + 1)
                decoding -= 1
            else:
                decoding -= seqs[i].role is Role.DECODING
                _drop(seqs, i, life, events)
        stuck = kv_full == "pause" and not any(
            s.role in (Role.DECODING, Role.PARKED) for s in seqs)
        paused = [i for i, s in enumerate(seqs) if s.role is Role.PAUSED]
        if not (stuck and paused and not _can_resume(seqs, budget)):
            return
        _drop(seqs, paused[-1], life, events)  # nothing else can run: the youngest makes room


def _resume(seqs: list[Seq], budget: int, life: Lifecycle, events: list[Event]) -> None:
    for i, s in enumerate(seqs):
        if s.role is Role.PAUSED:
            if not _can_resume(seqs, budget):
                return
            _fire(seqs, i, Trigger.RESUME, "kv_room", life, events)


def _can_resume(seqs: list[Seq], budget: int) -> bool:
    decoding = sum(s.role is Role.DECODING for s in seqs)
    return _committed(seqs, "pause") + decoding + 1 <= budget


def _youngest(seqs: list[Seq], roles: tuple[Role, ...] | None) -> int:
    for i in range(len(seqs) - 1, -1, -1):
        if seqs[i].role in roles if roles else seqs[i].role in KV_ROLES:
            return i
    raise AssertionError("KV over budget with nothing holding KV")


def _drop(seqs: list[Seq], i: int, life: Lifecycle, events: list[Event]) -> None:
    s = seqs[i]
    # Re-prefilled later: its prompt and every token it generated (the newest one included).
    _fire(seqs, i, Trigger.PREEMPT, "kv_full", life, events,
          target=s.prompt_len + s.generated, prefilled=0, wait=0, overtaken=0, queue=0,
          preemptions=s.preemptions + 1)


def _admit(seqs: list[Seq], kv_full: str, layout: Layout, life: Lifecycle,
           events: list[Event]) -> None:
    # Arrival order (a preempted sequence keeps its place); the head blocks those behind it.
    budget = layout.kv_budget
    counts, committed = _census(seqs, kv_full)
    if counts[Role.PAUSED]:
        return  # paused ones are older than anything queued: room goes to them first
    running = sum(counts[r] for r in KV_ROLES)
    decoding = counts[Role.DECODING] if kv_full != "queue" else 0
    for i, s in enumerate(seqs):
        if s.role not in (Role.QUEUED, Role.PREEMPTED):
            continue
        if running >= layout.max_running:
            return
        need = s.kv_reserved(kv_full) if budget is not None else 0
        if budget is not None and committed + need + decoding > budget:
            return
        trigger = Trigger.ADMIT if s.role is Role.QUEUED else Trigger.READMIT
        _fire(seqs, i, trigger, trigger.value, life, events, wait=0, overtaken=0)
        running += 1
        committed += need
