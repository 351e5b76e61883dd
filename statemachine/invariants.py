"""Invariants and claims, each written once and used by all three checkers: the exhaustive
checker, the Hypothesis stateful tests, and the scheduler core's own check after each tick."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from statemachine.lifecycle import KV_ROLES, Role
from statemachine.spec import BASE_CLAIMS
from statemachine.tick import Decision, Policy, TickState
from statemachine.world import Layout, Outcome, Seq, kv_cached


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


UNIVERSAL = ("lifecycle", "capacity", "no_idle_with_work", "well_formed", "no_starvation")


@dataclass(frozen=True)
class ClaimConfig:
    """The configuration claims are stated for: the running limit, the most live sequences,
    the longest prompt in chunks, and the largest max_tokens (None: generation may go on)."""

    max_running: int
    max_seqs: int
    max_chunks: int
    max_prompt_tokens: int
    max_tokens: int | None


@dataclass(frozen=True)
class Bounds:
    """A policy's claims evaluated for one configuration (None: unbounded)."""

    wait_ticks: int | None
    overtakes: int | None
    decode_wait_ticks: int | None
    queue_ticks: int | None
    preemptions: int | None
    first_grant_ticks: int | None
    ttft_by_grants: tuple[int | None, ...]  # index: the grants a prompt took
    horizon: int  # a wait this long counts as starvation when wait_ticks is unbounded

    @classmethod
    def of(cls, policy: Policy, cfg: ClaimConfig, max_grants: int, horizon: int = 64) -> Bounds:
        env: dict[str, int | None] = {
            "max_running": cfg.max_running, "max_seqs": cfg.max_seqs,
            "max_chunks": cfg.max_chunks, "chunks": cfg.max_chunks,
            "max_prompt_tokens": cfg.max_prompt_tokens, "max_tokens": cfg.max_tokens}
        base: dict[str, int | None] = {}
        for name in BASE_CLAIMS:  # each may use the ones before it
            base[name] = policy.claim(name, **env, **base)
        declared = policy.spec.claims
        first = policy.claim("first_grant_ticks", **env, **base) \
            if "first_grant_ticks" in declared else implied_first_grant(**base)
        env_first = {**env, **base, "first_grant_ticks": first}
        ttft = tuple(policy.claim("ttft_ticks", **{**env_first, "chunks": g})
                     if "ttft_ticks" in declared else implied_ttft(g, **base)
                     for g in range(max_grants + 1))
        return cls(wait_ticks=base["wait_ticks"], overtakes=base["overtakes"],
                   decode_wait_ticks=base["decode_wait_ticks"], queue_ticks=base["queue_ticks"],
                   preemptions=base["preemptions"], first_grant_ticks=first,
                   ttft_by_grants=ttft, horizon=horizon)

    def ttft(self, grants: int) -> int | None:
        return self.ttft_by_grants[min(grants, len(self.ttft_by_grants) - 1)]

    @property
    def implied(self) -> dict[str, bool]:
        """Which derived claims follow from the base claims (no ages need tracking for them):
        each is at least the bound that follows."""
        first = implied_first_grant(**self._base)
        return {
            "first_grant_ticks": _at_least(self.first_grant_ticks, first),
            "ttft_ticks": all(_at_least(t, implied_ttft(g, **self._base))
                              for g, t in enumerate(self.ttft_by_grants) if g > 0),
        }

    @property
    def _base(self) -> dict[str, int | None]:
        return {"wait_ticks": self.wait_ticks, "overtakes": self.overtakes,
                "decode_wait_ticks": self.decode_wait_ticks, "queue_ticks": self.queue_ticks,
                "preemptions": self.preemptions}


def implied_first_grant(wait_ticks: int | None, queue_ticks: int | None,
                        preemptions: int | None, **_: int | None) -> int | None:
    """Ticks from arrival to the end of the first grant's tick: each of the (preemptions + 1)
    stays queues <= queue_ticks and parks <= wait_ticks, then one tick grants."""
    if wait_ticks is None or queue_ticks is None or preemptions is None:
        return None
    return (preemptions + 1) * (queue_ticks + wait_ticks) + 1


def implied_ttft(grants: int, wait_ticks: int | None, queue_ticks: int | None,
                 preemptions: int | None, **_: int | None) -> int | None:
    """Ticks from arrival to the first token of a prompt granted `grants` times: every tick is
    a queue tick (<= queue_ticks per stay), a grant, or a parked tick (<= wait_ticks before
    each grant and before each preemption)."""
    if wait_ticks is None or queue_ticks is None or preemptions is None:
        return None
    return (preemptions + 1) * queue_ticks + grants * (wait_ticks + 1) + preemptions * wait_ticks


def _at_least(claim: int | None, follows: int | None) -> bool:
    return claim is None or (follows is not None and claim >= follows)


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


def check_capacity(seqs: Collection[Seq], layout: Layout) -> list[Violation]:
    """Never more sequences hold KV than the running limit, nor more tokens than the budget."""
    out = []
    running = sum(s.role in KV_ROLES for s in seqs)
    if running > layout.max_running:
        out.append(Violation("capacity", f"{running} sequences hold KV, the limit is "
                             f"{layout.max_running}"))
    if layout.kv_budget is None:
        return out
    cached = kv_cached(seqs)
    if cached > layout.kv_budget:
        out.append(Violation("capacity", f"{cached} tokens in KV caches, the budget is "
                             f"{layout.kv_budget}"))
    return out


def check_claims(outcome: Outcome, bounds: Bounds) -> list[Violation]:
    """The claims, on the world after a tick and the first grants and tokens in it."""
    out = []
    b = bounds

    def over(name: str, value: int, bound: int | None, seq: int, what: str) -> None:
        if bound is not None and value > bound:
            out.append(Violation(name, f"seq {seq} {what} {value}; claimed <= {bound}", seq))

    for s in outcome.world.seqs:
        if s.role is Role.PARKED:
            over("wait_ticks", s.wait, b.wait_ticks, s.seq_id, "parked without a grant for")
            over("overtakes", s.overtaken, b.overtakes, s.seq_id,
                 "overtaken while parked, times:")
            if b.wait_ticks is None and s.wait >= b.horizon:
                out.append(Violation("no_starvation", f"seq {s.seq_id} parked {s.wait} ticks "
                                     "without a grant (the starvation horizon)", s.seq_id))
        if s.role in (Role.QUEUED, Role.PREEMPTED):
            over("queue_ticks", s.queue, b.queue_ticks, s.seq_id, "waited for KV room, ticks:")
        over("preemptions", s.preemptions, b.preemptions, s.seq_id, "preempted, times:")
    for seq, age in outcome.first_grants:
        over("first_grant_ticks", age, b.first_grant_ticks, seq, "got its first grant after")
    for seq, age, grants in outcome.completed:
        over("ttft_ticks", age, b.ttft(grants), seq,
             f"({grants} grants) got its first token after")
    if b.decode_wait_ticks is not None and outcome.world.dwait > b.decode_wait_ticks:
        out.append(Violation("decode_wait_ticks", f"decoding sequences went "
                             f"{outcome.world.dwait} ticks without a step; claimed <= "
                             f"{b.decode_wait_ticks}"))
    return out
