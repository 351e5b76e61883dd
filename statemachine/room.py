"""KV room and admission, the part of a tick before the policy decides: when the decoding
streams' next tokens do not fit the budget, the youngest running sequences pause or are
preempted (as the policy's `kv_full` says); then queued and preempted sequences are admitted
in arrival order while the head fits. Called by `world.begin_tick`, and by `world.fork` to ask
whether a sibling choice fits as an arrival would."""

from __future__ import annotations

from statemachine.lifecycle import KV_ROLES, Lifecycle, Role, Trigger
from statemachine.records import Event, Layout, Seq


def fire(seqs: list[Seq], i: int, trigger: Trigger, rule: str, life: Lifecycle,
          events: list[Event], **changes: int) -> None:
    s = seqs[i]._replace(**changes)  # type: ignore[arg-type]
    dst = life.move(s.role, trigger, s)
    events.append(Event(s.seq_id, trigger, s.role, dst, rule, s))
    seqs[i] = s._replace(role=dst)


def census(seqs: list[Seq], kv_full: str) -> tuple[list[int], int]:
    # How many sequences have each role, and the KV tokens those holding KV have reserved.
    counts, committed = [0] * len(Role), 0
    for s in seqs:
        counts[s.role] += 1
        if s.role in KV_ROLES:
            committed += s.kv_reserved(kv_full)
    return counts, committed


def _committed(seqs: list[Seq], kv_full: str) -> int:
    return sum(s.kv_reserved(kv_full) for s in seqs if s.role in KV_ROLES)


def make_room(seqs: list[Seq], kv_full: str, budget: int, life: Lifecycle,
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
                fire(seqs, i, Trigger.PAUSE, rule, life, events,
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
            fire(seqs, i, Trigger.RESUME, "kv_room", life, events)


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
    fire(seqs, i, Trigger.PREEMPT, "kv_full", life, events,
          target=s.prompt_len + s.generated, prefilled=0, wait=0, overtaken=0, queue=0,
          preemptions=s.preemptions + 1)


def admit(seqs: list[Seq], kv_full: str, layout: Layout, life: Lifecycle,
           events: list[Event]) -> None:
    # Arrival order (a preempted sequence keeps its place); the head blocks those behind it.
    budget = layout.kv_budget
    counts, committed = census(seqs, kv_full)
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
        fire(seqs, i, trigger, trigger.value, life, events, wait=0, overtaken=0)
        running += 1
        committed += need


def can_fork(seqs: tuple[Seq, ...], rec: Seq, kv_full: str, layout: Layout) -> bool:
    """Whether a sibling `rec` may be born decoding now: admission would let it in (nothing
    queued, preempted or paused is ahead of it, a running place is free) and its KV, next to
    one more token of every decoding row and its own, fits the budget."""
    counts, committed = census(list(seqs), kv_full)
    if counts[Role.QUEUED] or counts[Role.PREEMPTED] or counts[Role.PAUSED]:
        return False
    if sum(counts[r] for r in KV_ROLES) >= layout.max_running:
        return False
    if layout.kv_budget is None:
        return True
    decoding = counts[Role.DECODING] + 1 if kv_full != "queue" else 0
    return committed + rec.kv_reserved(kv_full) + decoding <= layout.kv_budget
