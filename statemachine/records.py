"""The records the step function works on: a sequence (`Seq`), the world of them, the layout a
scheduler runs, and what a tick plans and produces. Plain named tuples and frozen dataclasses,
no logic beyond a sequence's own KV arithmetic."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import NamedTuple

from statemachine.lifecycle import KV_ROLES, Role, Trigger
from statemachine.tick import Decision, TickState


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


def new_seq(seq_id: int, prompt_len: int, max_tokens: int | None, cached: int = 0) -> Seq:
    """A sequence that just arrived (role queued); the first `cached` prompt tokens came from
    the prefix cache, already in its KV (it prefills only the rest)."""
    if not 0 <= cached < prompt_len:
        raise ValueError(f"cached prompt tokens must be in [0, {prompt_len - 1}] (the last "
                         f"prompt token always runs), got {cached}")
    return Seq(seq_id, Role.QUEUED, prompt_len, max_tokens, prompt_len, prefilled=cached)


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


def kv_cached(seqs: Collection[Seq]) -> int:
    """Tokens in the KV caches of all sequences."""
    return sum(s.kv_cached for s in seqs)
