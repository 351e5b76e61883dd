"""The checker's canonical form of a world: a hashable key with every counter the abstraction
drops or caps, sequences renumbered, and, where no preemption can happen, running sequences
the policy cannot tell apart in one order (statemachine/abstraction.py says which, and why
each is exact)."""

from __future__ import annotations

from typing import Any

from statemachine.abstraction import Abstraction
from statemachine.lifecycle import Role
from statemachine.world import Seq, World

Key = tuple[Any, ...]
SOME = 1 << 20  # prompt tokens left when progress is not tracked: more than any slice


class Canon:
    """Keys for one abstraction and layout. `grouped`: no preemption, so only arrival order
    within the parked and the queued matters; `reduce=False`: the naive explorer's keys
    (arrival order, every sequence's counters)."""

    def __init__(self, abstraction: Abstraction, kv_budget: int | None, max_tokens: int | None,
                 grouped: bool, reduce: bool) -> None:
        self.abs, self.grouped, self.reduce = abstraction, grouped, reduce
        self.kv, self.max_tokens = kv_budget is not None, max_tokens

    def key(self, world: World) -> Key:
        """The canonical, hashable form of a world: counters capped or dropped as the
        abstraction allows, sequences renumbered (and grouped where order cannot matter)."""
        recs = [self.seq_key(s) for s in world.seqs]
        order = self.order(world, recs)
        if self.abs.rank_waits:
            self._rank(world, recs, order)
        return (min(world.streak, self.abs.streak_cap), min(world.dwait, self.abs.dwait_cap),
                *(recs[i] for i in order))

    def _rank(self, world: World, recs: list[tuple[int, ...]], order: list[int]) -> None:
        # The policy sees parked waits only through their order: an unobserved prompt's wait
        # becomes the smallest value with the same order (ties included) relative to the
        # others and to the observed prompt's exact wait. It never exceeds the true wait
        # where it could matter for a claim, and it grows and resets the same way.
        parked = [i for i in order if world.seqs[i].role is Role.PARKED]
        values = sorted({world.seqs[i].wait for i in parked}, reverse=True)
        observed = next((i for i in parked if world.seqs[i].observed), None)
        if observed is None:
            synthetic = {v: len(values) - 1 - r for r, v in enumerate(values)}
        else:
            anchor, exact = values.index(world.seqs[observed].wait), recs[observed][7]
            synthetic = {v: max(0, exact + anchor - r) for r, v in enumerate(values)}
        for i in parked:
            if i != observed:
                r = recs[i]
                recs[i] = (*r[:7], synthetic[world.seqs[i].wait], *r[8:])

    def order(self, world: World, recs: list[tuple[int, ...]] | None = None) -> list[int]:
        """Positions of `world.seqs` in canonical order."""
        n = len(world.seqs)
        if not self.grouped:
            return list(range(n))
        recs = recs if recs is not None else [self.seq_key(s) for s in world.seqs]
        role = [s.role for s in world.seqs]
        parked = [i for i in range(n) if role[i] is not Role.DECODING
                  and role[i] is not Role.QUEUED]
        if self.abs.sort_parked:  # stable: ties stay in arrival order
            parked.sort(key=lambda i: -world.seqs[i].wait)
        decoding = sorted((i for i in range(n) if role[i] is Role.DECODING),
                          key=lambda i: recs[i])
        return parked + decoding + [i for i in range(n) if role[i] is Role.QUEUED]

    def seq_key(self, s: Seq) -> tuple[Any, ...]:
        """One sequence's part of a key: what the abstraction keeps of it."""
        a, kv = self.abs, self.kv
        obs, role = s.observed, s.role
        if obs and role is Role.DECODING and not a.preemptions_cap and s.generated and \
                self.reduce:
            obs = False  # nothing of it is left to track: let another sequence be observed
        parked = role is Role.PARKED
        before_first = s.generated == 0
        return (
            role, obs,
            s.prompt_len if kv else 0,
            s.max_tokens or 0,
            s.target if kv else self._left(s),
            s.prefilled if kv else 0,
            s.generated if kv or self.max_tokens is not None else min(s.generated, 1),
            min(s.wait, a.wait_cap) if parked and (obs or a.wait_visible) else 0,
            min(s.overtaken, a.overtaken_cap) if parked and obs else 0,
            min(s.queue, a.queue_cap) if obs and role in (Role.QUEUED, Role.PREEMPTED) else 0,
            min(s.age, a.age_cap) if obs and before_first else 0,
            min(s.grants, a.grants_cap) if obs and before_first else 0,
            min(s.preemptions, a.preemptions_cap) if obs else 0,
        )

    def _left(self, s: Seq) -> int:
        left = s.target - s.prefilled
        return left if self.abs.progress or left == 0 else SOME

    @staticmethod
    def decode(key: Key) -> World:
        """The world a canonical key stands for (sequence ids are positions)."""
        streak, dwait, *recs = key
        seqs = tuple(Seq(i, r[0], r[2], r[3] or None, r[4], r[5], r[6], r[7], r[8], r[9],
                         r[10], r[11], r[12], r[1]) for i, r in enumerate(recs))
        return World(seqs, streak, dwait)

    def visible_key(self, world: World) -> Key:
        """What the policy can see of `world` (no observed sequence's claim counters)."""
        return self.key(world._replace(seqs=tuple(s._replace(observed=False)
                                                  for s in world.seqs)))


