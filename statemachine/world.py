"""The one step function: how a tick, an abort and a finish change the sequences.

The scheduler core (over its `transitions` models), the exhaustive checker (over tuples) and
the Hypothesis machine (through the scheduler) all call these functions, so the checker
explores exactly what runs. A tick is two calls around the executor:

1. `begin_tick` makes KV room for the tick's decode tokens (the youngest running sequences
   pause or are preempted, as the policy's `kv_full` says), admits queued and preempted
   sequences in arrival order while they fit, asks `decide_tick`, and grants.
2. `end_tick` applies what ran: prefill slices done (the last one yields a token), one token
   per decoding row, sequences at their max_tokens finished, and every counter moved.

`leave` is an abort or a finish between ticks; `fork` is a sibling choice of a request with
`n` > 1 born decoding between ticks, right after its prompt gave its first token. Sequences are
`Seq` records in arrival order (statemachine/records.py); the KV room and admission are
statemachine/room.py.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from statemachine.lifecycle import Lifecycle, Role, Trigger
from statemachine.records import (
    Event,
    Layout,
    Outcome,
    Plan,
    PrefillWork,
    Seq,
    World,
    admissible,
    kv_cached,
    new_seq,
)
from statemachine.room import admit, can_fork, census, fire, make_room
from statemachine.tick import Decision, ParkedPrefill, Policy, PolicyMemory, TickState, decide_tick

__all__ = ["Arranged", "Budget", "Event", "Layout", "Outcome", "Plan", "PrefillWork", "Seq",
           "World", "admissible", "arrange", "begin_tick", "end_tick", "extra_room", "fork",
           "grant", "kv_cached", "lane_tick", "leave", "new_seq", "tick_state"]


Budget = Callable[[TickState], int]


@dataclass(frozen=True)
class Arranged:
    """A tick with KV room made and arrivals admitted, before the policy decides."""

    world: World
    seqs: tuple[Seq, ...]
    events: tuple[Event, ...]
    state: TickState


def begin_tick(world: World, policy: Policy, life: Lifecycle, layout: Layout,
               budget: Budget | None = None,
               decide: Callable[[TickState, Policy], Decision] = decide_tick) -> Plan:
    """Make KV room, admit, decide and grant. `budget` gives the prefill tokens that fit the
    tick's latency target; it is asked only in a contended tick of a policy that has one.
    `decide` is `decide_tick` (the checker passes it remembered)."""
    return grant(arrange(world, policy, life, layout), policy, life, budget, decide)


def arrange(world: World, policy: Policy, life: Lifecycle, layout: Layout) -> Arranged:
    """The first half of `begin_tick`: KV room made, arrivals admitted, the policy's view."""
    seqs, events = list(world.seqs), list[Event]()
    kv_full, budget_kv = policy.spec.kv_full, layout.kv_budget
    counts, committed = census(seqs, kv_full)
    waiting = counts[Role.QUEUED] + counts[Role.PREEMPTED]
    if budget_kv is not None and kv_full != "queue" and \
            (committed + counts[Role.DECODING] > budget_kv or counts[Role.PAUSED]):
        make_room(seqs, kv_full, budget_kv, life, events)
    if waiting:
        admit(seqs, kv_full, layout, life, events)
    return Arranged(world, tuple(seqs), tuple(events), tick_state(seqs, world, layout))


def grant(arranged: Arranged, policy: Policy, life: Lifecycle, budget: Budget | None = None,
          decide: Callable[[TickState, Policy], Decision] = decide_tick) -> Plan:
    """The second half of `begin_tick`: decide on the arranged tick and grant (the checker
    grants one arranged tick under each budget it explores)."""
    seqs, events, state = list(arranged.seqs), list(arranged.events), arranged.state
    if budget is not None and state.parked and state.num_decoding and \
            policy.spec.tick_budget_ms is not None:
        state = state._replace(budget_tokens=budget(state))
    decision = decide(state, policy)
    where = {s.seq_id: i for i, s in enumerate(seqs)} if decision.granted else {}
    prefills = []
    for seq_id in decision.granted:
        s = seqs[where[seq_id]]
        left = s.target - s.prefilled
        fire(seqs, where[seq_id], Trigger.GRANT, decision.rule, life, events,
             grants=s.grants + 1)
        prefills.append(PrefillWork(seq_id, min(decision.chunk_tokens, left)))
    decode = tuple(s.seq_id for s in seqs if s.role is Role.DECODING) \
        if decision.decodes else ()
    world = arranged.world
    return Plan(World(tuple(seqs), world.streak, world.dwait), state, decision,
                tuple(prefills), decode, tuple(events))


def end_tick(plan: Plan, life: Lifecycle, extra: int = 0) -> Outcome:
    """Apply what `plan` ran (sequences that left since `begin_tick` are skipped). `extra`:
    the decode rows' steps past their one in a lane tick (ADR 0016), each row stopping at its
    max_tokens; at most `extra_room` allows."""
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
            generated += 1 + extra
            if s.max_tokens is not None:
                generated = min(generated, s.max_tokens)
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


def lane_tick(plan: Plan, policy: Policy) -> bool:
    """Whether `plan` is a lane tick (ADR 0016): the policy has a lane, and the tick both
    decodes and grants (its slices run on the lane, the rows step one or more times)."""
    return policy.spec.lane is not None and bool(plan.prefills) and bool(plan.decode)


def extra_room(plan: Plan, life: Lifecycle, kv_full: str, layout: Layout) -> int:
    """How many steps past their one the decode rows of `plan` may take in a lane tick: as
    many as keep room, after the tick, for every decoding row's next token within the KV
    budget (as `begin_tick` makes room for), so that no extra step makes anyone be preempted.
    Without a KV budget, or under `kv_full: queue` (each sequence holds all it may generate),
    no limit but each row's max_tokens (`end_tick` stops each row there)."""
    rows = len(plan.decode)
    if not rows or layout.kv_budget is None or kv_full == "queue":
        return 2**31
    after = end_tick(plan, life).world.seqs
    counts, committed = census(list(after), kv_full)
    free = layout.kv_budget - committed - counts[Role.DECODING]
    return max(0, free // rows)


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


def fork(world: World, seq_id: int, prompt_len: int, max_tokens: int | None, kv_full: str,
         life: Lifecycle, layout: Layout, rule: str = "fork") -> tuple[World, Event] | None:
    """A sibling choice of a prompt that just gave its first token: it arrives and is born
    decoding (`fork`) on a copy of that prompt's KV with a first token of its own, when it fits
    as an arrival would be admitted (`room.can_fork`); else None and the world is unchanged (the
    caller then submits it as an arrival that prefills the prompt itself)."""
    rec = Seq(seq_id, Role.QUEUED, prompt_len, max_tokens, prompt_len, prefilled=prompt_len,
              generated=1)
    if not can_fork(world.seqs, rec, kv_full, layout):
        return None
    dst = life.move(Role.QUEUED, Trigger.FORK, rec)
    event = Event(seq_id, Trigger.FORK, Role.QUEUED, dst, rule, rec)
    return World((*world.seqs, rec._replace(role=dst)), world.streak, world.dwait), event


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


# -- internals ---------------------------------------------------------------------------------
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


