"""The pure core of scheduling: a flattened `TickState`, a bound `Policy`, and `decide_tick`.

`decide_tick` reads nothing but its arguments and changes nothing; the Decision it returns
carries the policy memory for the next tick, so no caller can take one without the other.
`parked_after_tick` and `decode_wait_after_tick` are the one definition of how the per-tick
counters move; the scheduler core and the exhaustive checker both use them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from statemachine.spec import Action, PolicySpec, load_policy


@dataclass(frozen=True)
class PolicyMemory:
    """What a policy carries from one tick to the next."""

    decode_streak: int = 0  # consecutive decode-only ticks while a prefill was parked


@dataclass(frozen=True)
class ParkedPrefill:
    """A sequence that holds a slot and waits for a tick to run its next prompt chunk."""

    seq_id: int
    wait_ticks: int = 0
    chunks_left: int = 1
    num_chunks: int = 1
    age_ticks: int = 0
    overtaken: int = 0


@dataclass(frozen=True)
class TickState:
    """Everything a policy may look at, as of the start of a tick. `parked` is in admission
    order (oldest first)."""

    num_slots: int
    num_waiting: int = 0
    num_decoding: int = 0
    parked: tuple[ParkedPrefill, ...] = ()
    decode_wait_ticks: int = 0  # ticks the decoding sequences have gone without a step
    chunk_size: int = 1
    budget_tokens: int | None = None  # prefill tokens that fit this tick's latency target
    memory: PolicyMemory = field(default_factory=PolicyMemory)

    @property
    def num_parked(self) -> int:
        return len(self.parked)

    @property
    def num_free_slots(self) -> int:
        return self.num_slots - self.num_parked - self.num_decoding

    def env(self) -> dict[str, int]:
        """The state fields by the names policy expressions use."""
        return {
            "num_slots": self.num_slots, "num_free_slots": self.num_free_slots,
            "num_waiting": self.num_waiting, "num_parked": len(self.parked),
            "num_decoding": self.num_decoding, "decode_streak": self.memory.decode_streak,
            "decode_wait_ticks": self.decode_wait_ticks,
            "max_wait_ticks": max((p.wait_ticks for p in self.parked), default=0),
            "chunk_size": self.chunk_size,
            "budget_tokens": self.chunk_size if self.budget_tokens is None
            else self.budget_tokens,
        }


@dataclass(frozen=True)
class Decision:
    """What one tick does: `action`, the parked prefills `granted` a chunk of `chunk_tokens`
    tokens each, the `rule` that decided, and the policy `memory` for the next tick."""

    action: Action
    rule: str
    granted: tuple[int, ...] = ()
    chunk_tokens: int = 0
    memory: PolicyMemory = field(default_factory=PolicyMemory)

    @property
    def decodes(self) -> bool:
        return self.action in ("decode", "mixed")


@dataclass(frozen=True)
class Policy:
    """A policy spec with its parameters bound to values."""

    spec: PolicySpec
    params: Mapping[str, int | float]

    @property
    def name(self) -> str:
        return self.spec.name

    def claim(self, name: str, **config: int) -> int | None:
        """The bound a claim states for `config` (slots, chunks, max_chunks); None: unbounded."""
        expr = self.spec.claims[name]
        return None if expr is None else int(expr({**self.params, **config}))


def make_policy(spec: PolicySpec | str, overrides: Mapping[str, Any] | None = None,
                origin: str = "--set") -> Policy:
    """Bind `spec`'s parameters: its defaults, replaced by `overrides` (validated)."""
    if isinstance(spec, str):
        spec = load_policy(spec)
    params: dict[str, int | float] = dict(spec.defaults)
    for name, value in (overrides or {}).items():
        try:
            param = spec.parameter(name)
        except KeyError:
            known = ", ".join(p.name for p in spec.parameters) or "none"
            raise ValueError(f"{origin}: policy {spec.name!r} has no parameter {name!r}; "
                             f"its parameters: {known}") from None
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{origin}: {name} must be a number, got {value!r}") from None
        params[name] = param.validate(number, origin)
    return Policy(spec, params)


def decide_tick(state: TickState, policy: Policy) -> Decision:
    """Choose this tick's action by the first matching rule; grant parked prefills by the
    policy's pick rule when the action prefills."""
    env = {**state.env(), **policy.params}
    for rule in policy.spec.rules:
        if rule.when(env):
            break
    else:
        return Decision("idle", "<no rule matched>", memory=PolicyMemory())
    streak = state.memory.decode_streak + 1 if rule.action == "decode" and state.parked else 0
    memory = PolicyMemory(decode_streak=streak)
    if rule.action not in ("prefill", "mixed") or not state.parked:
        return Decision(rule.action, rule.name, memory=memory)
    order = pick_order(state, policy.spec.pick)
    granted = tuple(p.seq_id for p in order[: max(1, int(policy.spec.grants(env)))])
    chunk_tokens = max(1, int(policy.spec.chunk_tokens(env)))
    return Decision(rule.action, rule.name, granted, chunk_tokens, memory)


def pick_order(state: TickState, pick: str) -> list[ParkedPrefill]:
    """The parked prefills in the order `pick` grants them."""
    parked = list(state.parked)
    if pick == "round_robin":
        # Least recently served first: a granted prefill goes to the back of the line and a
        # new one joins behind it. (A cursor over seq ids would let new arrivals overtake.)
        return sorted(parked, key=lambda p: -p.wait_ticks)  # stable: ties go to the oldest
    if pick == "fewest_left":
        return sorted(parked, key=lambda p: p.chunks_left)
    return parked  # oldest_first


def decode_wait_after_tick(state: TickState, decision: Decision) -> int:
    """Ticks the decoding sequences have gone without a step, after this tick."""
    if decision.decodes or state.num_decoding == 0:
        return 0
    return state.decode_wait_ticks + 1


def parked_after_tick(p: ParkedPrefill, decision: Decision) -> tuple[int, int, int]:
    """(wait_ticks, age_ticks, overtaken) of a parked prefill after one tick."""
    granted = p.seq_id in decision.granted
    others = len(decision.granted) - granted
    if granted:
        return 0, p.age_ticks + 1, 0
    return p.wait_ticks + 1, p.age_ticks + 1, p.overtaken + others
