"""Invariants and claim checks, written once and used by all three checkers: the exhaustive
checker, the Hypothesis stateful tests, and the scheduler core's own check after each tick."""

from __future__ import annotations

from dataclasses import dataclass

from statemachine.tick import Decision, Policy, TickState


@dataclass(frozen=True)
class Violation:
    """A broken invariant or claim: `name` is the claim or invariant, `message` says how."""

    name: str
    message: str
    seq: int | None = None


class InvariantViolation(AssertionError):
    """Raised by the scheduler core when its own check finds a violation."""

    def __init__(self, violations: list[Violation]) -> None:
        super().__init__("; ".join(f"{v.name}: {v.message}" for v in violations))
        self.violations = violations


UNIVERSAL = ("lifecycle", "slots", "no_idle_with_work", "well_formed", "no_starvation")


def check_decision(state: TickState, decision: Decision) -> list[Violation]:
    """The decision is well formed and never idles while there is work."""
    out = []
    if decision.action == "idle" and (state.parked or state.num_decoding):
        out.append(Violation("no_idle_with_work", f"idle tick with {state.num_parked} parked "
                             f"and {state.num_decoding} decoding (rule {decision.rule})"))
    parked = {p.seq_id for p in state.parked}
    prefills = decision.action in ("prefill", "mixed")
    if prefills and not decision.granted:
        out.append(Violation("well_formed", f"{decision.action} tick grants nothing"))
    if not prefills and decision.granted:
        out.append(Violation("well_formed", f"{decision.action} tick grants prefills"))
    if not set(decision.granted) <= parked:
        out.append(Violation("well_formed", f"granted {decision.granted} not all parked"))
    if decision.decodes and state.num_decoding == 0:
        out.append(Violation("well_formed", f"{decision.action} tick with nothing decoding"))
    return out


def check_slots(num_holding: int, num_slots: int) -> list[Violation]:
    """Slot conservation: never more sequences hold a slot than there are slots."""
    if num_holding > num_slots:
        return [Violation("slots", f"{num_holding} sequences hold slots, only {num_slots}")]
    return []


@dataclass(frozen=True)
class Bounds:
    """A policy's claims evaluated for one configuration (None: unbounded)."""

    wait_ticks: int | None
    overtakes: int | None
    decode_wait_ticks: int | None
    ttft_by_chunks: tuple[int | None, ...]  # index: the prompt's chunks
    horizon: int  # a wait this long counts as starvation when wait_ticks is unbounded

    @classmethod
    def of(cls, policy: Policy, slots: int, max_chunks: int, horizon: int = 64) -> Bounds:
        cfg = {"slots": slots, "max_chunks": max_chunks, "chunks": max_chunks}
        return cls(
            wait_ticks=policy.claim("wait_ticks", **cfg),
            overtakes=policy.claim("overtakes", **cfg),
            decode_wait_ticks=policy.claim("decode_wait_ticks", **cfg),
            ttft_by_chunks=tuple(policy.claim("ttft_ticks", **{**cfg, "chunks": c})
                                 for c in range(max_chunks + 1)),
            horizon=horizon,
        )

    def ttft(self, chunks: int) -> int | None:
        return self.ttft_by_chunks[min(chunks, len(self.ttft_by_chunks) - 1)]


def check_claims(after: TickState, bounds: Bounds,
                 completed: tuple[tuple[int, int, int], ...] = (),
                 parked_ttft: bool = True) -> list[Violation]:
    """Claims on the state after a tick; `completed` lists (seq, age_ticks, chunks) of the
    prompts whose last chunk ran in that tick. `parked_ttft=False` checks TTFT only on
    completion (when slices vary in size, a parked prompt's chunk count is not known yet)."""
    out = []
    for p in after.parked:
        if bounds.wait_ticks is not None and p.wait_ticks > bounds.wait_ticks:
            out.append(Violation("wait_ticks", f"seq {p.seq_id} parked {p.wait_ticks} ticks "
                                 f"without a grant; claimed <= {bounds.wait_ticks}", p.seq_id))
        if bounds.wait_ticks is None and p.wait_ticks >= bounds.horizon:
            out.append(Violation("no_starvation", f"seq {p.seq_id} parked {p.wait_ticks} ticks "
                                 f"without a grant (the starvation horizon)", p.seq_id))
        if bounds.overtakes is not None and p.overtaken > bounds.overtakes:
            out.append(Violation("overtakes", f"seq {p.seq_id} overtaken {p.overtaken} times "
                                 f"while parked; claimed <= {bounds.overtakes}", p.seq_id))
        ttft = bounds.ttft(p.num_chunks) if parked_ttft else None
        if ttft is not None and p.age_ticks >= ttft:
            out.append(Violation("ttft_ticks", f"seq {p.seq_id} ({p.num_chunks} chunks) still "
                                 f"parked after {p.age_ticks} ticks; claimed <= {ttft}",
                                 p.seq_id))
    for seq, age, chunks in completed:
        ttft = bounds.ttft(chunks)
        if ttft is not None and age > ttft:
            out.append(Violation("ttft_ticks", f"seq {seq} ({chunks} chunks) took {age} ticks "
                                 f"to its first token; claimed <= {ttft}", seq))
    dwait = bounds.decode_wait_ticks
    if dwait is not None and after.decode_wait_ticks > dwait:
        out.append(Violation("decode_wait_ticks", f"decoding sequences went "
                             f"{after.decode_wait_ticks} ticks without a step; claimed <= {dwait}"))
    return out
