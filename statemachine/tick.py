"""The pure core of scheduling: a flattened `TickState`, a bound `Policy`, and `decide_tick`.

`decide_tick` reads nothing but its arguments and changes nothing; the Decision it returns
carries the policy memory for the next tick, so no caller can take one without the other.
How a Decision changes the sequences is `statemachine.world` (the one step function).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from statemachine.spec import Action, PolicySpec, load_policy


class PolicyMemory(NamedTuple):
    """What a policy carries from one tick to the next."""

    decode_streak: int = 0  # consecutive decode-only ticks while a prefill was parked


class ParkedPrefill(NamedTuple):
    """A sequence that holds KV and waits for a tick to run its next prompt slice."""

    seq_id: int
    wait_ticks: int = 0
    chunks_left: int = 1


class TickState(NamedTuple):
    """Everything a policy may look at, as of the start of a tick (after admission). `parked`
    is in arrival order (oldest first). A named tuple: the checker hashes millions of them."""

    max_running: int
    num_running: int = 0
    num_waiting: int = 0  # queued or preempted: no KV held
    num_decoding: int = 0
    num_paused: int = 0
    parked: tuple[ParkedPrefill, ...] = ()
    decode_wait_ticks: int = 0  # ticks the decoding sequences have gone without a step
    chunk_size: int = 1
    budget_tokens: int | None = None  # prefill tokens that fit this tick's latency target
    memory: PolicyMemory = PolicyMemory()

    @property
    def num_parked(self) -> int:
        return len(self.parked)

    def env(self) -> dict[str, int]:
        """The state fields by the names policy expressions use."""
        return {
            "max_running": self.max_running, "num_running": self.num_running,
            "num_waiting": self.num_waiting, "num_parked": len(self.parked),
            "num_decoding": self.num_decoding, "num_paused": self.num_paused,
            "decode_streak": self.memory.decode_streak,
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
    memory: PolicyMemory = PolicyMemory()

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

    def claim(self, name: str, **config: int | None) -> int | None:
        """The bound a declared claim states for `config` (max_running, max_seqs, chunks,
        max_chunks, max_tokens, and for a derived claim the base claims' values); None when it
        is unbounded, or uses a configuration value that is (max_tokens=None: no limit)."""
        expr = self.spec.claims.get(name)
        if expr is None:
            return None
        env = {**self.params, **config}
        if any(env.get(n) is None for n in expr.names):
            return None
        value = int(expr(env))
        if value < 0:  # a bound counts ticks or preemptions
            used = ", ".join(f"{n}={env[n]}" for n in sorted(expr.names))
            raise ValueError(f"claim {name}: {expr.source!r} is {value} at {used}; a bound "
                             "must be >= 0")
        return value


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
