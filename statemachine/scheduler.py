"""The scheduler core: owns the sequence models, builds the TickState, applies Decisions.

No MLX here. Each tick is two calls: `schedule()` admits waiting sequences into free slots,
asks `decide_tick`, fires the grants and returns a `TickPlan` for the executor; `complete()`
takes what the executor finished, fires chunk_done/finish and moves the counters. Every
lifecycle change goes through a trigger of the one shared Machine and into the trace.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace

from statemachine.invariants import (
    Bounds,
    InvariantViolation,
    check_claims,
    check_decision,
    check_slots,
)
from statemachine.lifecycle import Lifecycle, load_lifecycle
from statemachine.sequence import Sequence
from statemachine.tick import (
    Decision,
    ParkedPrefill,
    Policy,
    PolicyMemory,
    TickState,
    decide_tick,
    decode_wait_after_tick,
    parked_after_tick,
)
from statemachine.trace import TraceEvent, TraceLog


@dataclass(frozen=True)
class PrefillWork:
    """Run the next `num_tokens` prompt tokens of `seq_id`."""

    seq_id: int
    num_tokens: int


@dataclass(frozen=True)
class TickPlan:
    """What the executor runs in one tick: the prefill chunks, then one batched decode step."""

    tick: int
    decision: Decision
    state: TickState
    prefills: tuple[PrefillWork, ...]
    decode: tuple[int, ...]


class Scheduler:
    """The declarative scheduler over live sequences; see the module docstring."""

    def __init__(self, policy: Policy, num_slots: int, chunk_size: int,
                 lifecycle: Lifecycle | None = None, trace: TraceLog | None = None,
                 check: bool = False, clock: Callable[[], float] = time.monotonic,
                 can_admit: Callable[[Sequence], bool] | None = None) -> None:
        if num_slots < 1 or chunk_size < 1:
            raise ValueError(f"num_slots and chunk_size must be >= 1, got {num_slots}, "
                             f"{chunk_size}")
        self.policy, self.num_slots, self.chunk_size = policy, num_slots, chunk_size
        self.lifecycle = lifecycle or load_lifecycle()
        self.machine = self.lifecycle.make_machine()
        self.trace = trace if trace is not None else TraceLog()
        self.check, self.clock, self.can_admit = check, clock, can_admit
        self.tick = 0
        self.memory = PolicyMemory()
        self.decode_wait_ticks = 0
        self.max_chunks_seen = 1
        self._live: dict[int, Sequence] = {}  # submission order
        self._bounds: dict[int, Bounds] = {}

    # -- requests in -------------------------------------------------------------------
    def submit(self, seq_id: int, prompt_tokens: int) -> Sequence:
        """Queue a new sequence (state `waiting`)."""
        if seq_id in self._live:
            raise ValueError(f"sequence {seq_id} is already live")
        if prompt_tokens < 1:
            raise ValueError(f"a prompt needs at least one token, got {prompt_tokens}")
        seq = Sequence(seq_id, prompt_tokens, self.chunk_size)
        self.machine.add_model(seq, initial=self.lifecycle.initial)
        self._live[seq_id] = seq
        return seq

    def abort(self, seq_id: int) -> bool:
        """Abort a live sequence at once (between ticks); False if it is not live."""
        seq = self._live.get(seq_id)
        if seq is None:
            return False
        self._fire(seq, "abort", "abort")
        return True

    # -- one tick ------------------------------------------------------------------------
    def schedule(self, budget: Callable[[TickState], int] | None = None) -> TickPlan:
        """Admit, decide, grant. The caller runs the plan, then calls `complete`. `budget`
        gives the prefill tokens that fit this tick's latency target, for the admitted state."""
        self._admit()
        state = self.tick_state()
        if budget is not None:
            state = replace(state, budget_tokens=budget(state))
        decision = decide_tick(state, self.policy)
        if self.check:
            self._raise(check_decision(state, decision))
        prefills = []
        for seq_id in decision.granted:
            seq = self._live[seq_id]
            seq.num_grants += 1
            self._fire(seq, "grant", decision.rule)
            prefills.append(PrefillWork(seq_id, min(decision.chunk_tokens, seq.prefill_left)))
        decode = tuple(s.seq_id for s in self._live.values() if s.state == "decoding") \
            if decision.decodes else ()
        return TickPlan(self.tick, decision, state, tuple(prefills), decode)

    def complete(self, plan: TickPlan, finished: Collection[int] = ()) -> None:
        """Apply the outcome of `plan`: chunks done, sequences `finished` (stop or length)."""
        rule = plan.decision.rule
        completed = []
        for work in plan.prefills:
            seq = self._live.get(work.seq_id)
            if seq is None:
                continue
            seq.prefill_left -= work.num_tokens
            self._fire(seq, "chunk_done", rule)
            if seq.state == "decoding":
                completed.append((seq.seq_id, seq.age_ticks + 1, seq.num_grants))
                self.max_chunks_seen = max(self.max_chunks_seen, seq.num_grants)
        for p in plan.state.parked:
            seq = self._live.get(p.seq_id)
            if seq is not None:
                seq.wait_ticks, seq.age_ticks, seq.overtaken = \
                    parked_after_tick(p, plan.decision)
        for seq_id in finished:
            seq = self._live.get(seq_id)
            if seq is not None and seq.state == "decoding":
                self._fire(seq, "finish", rule)
        self.decode_wait_ticks = decode_wait_after_tick(plan.state, plan.decision)
        self.memory = plan.decision.memory
        self.tick += 1
        if self.check:
            after = self.tick_state()
            self._raise(check_slots(self.num_holding_slots, self.num_slots)
                        + check_claims(after, self.bounds(), tuple(completed),
                                       parked_ttft=self.policy.spec.tick_budget_ms is None))

    # -- derived views ---------------------------------------------------------------------
    def tick_state(self) -> TickState:
        """The flattened snapshot a policy decides on."""
        parked, num_waiting, num_decoding = [], 0, 0
        for s in self._live.values():
            if s.state == "parked_prefill":
                parked.append(ParkedPrefill(s.seq_id, s.wait_ticks, s.chunks_left,
                                            s.chunks_expected, s.age_ticks, s.overtaken))
            elif s.state == "decoding":
                num_decoding += 1
            elif s.state == "waiting":
                num_waiting += 1
        return TickState(self.num_slots, num_waiting, num_decoding, tuple(parked),
                         self.decode_wait_ticks if num_decoding else 0, self.chunk_size,
                         None, self.memory)

    @property
    def num_holding_slots(self) -> int:
        return sum(s.state in self.lifecycle.slot_states for s in self._live.values())

    def sequence(self, seq_id: int) -> Sequence | None:
        return self._live.get(seq_id)

    def sequences(self) -> list[Sequence]:
        """The live sequences, in submission order."""
        return list(self._live.values())

    def bounds(self) -> Bounds:
        """The policy's claims for this scheduler's slots and the longest prompt seen."""
        if self.max_chunks_seen not in self._bounds:
            self._bounds[self.max_chunks_seen] = Bounds.of(
                self.policy, self.num_slots, self.max_chunks_seen, horizon=2**62)
        return self._bounds[self.max_chunks_seen]

    # -- internals -----------------------------------------------------------------------
    def _admit(self) -> None:
        free = self.num_slots - self.num_holding_slots
        for seq in list(self._live.values()):
            if free <= 0:
                break
            if seq.state == "waiting":
                if self.can_admit is not None and not self.can_admit(seq):
                    break  # FIFO: a sequence that does not fit blocks the ones behind it
                self._fire(seq, "admit", "admit")
                self.max_chunks_seen = max(self.max_chunks_seen, seq.num_chunks)
                free -= 1

    def _fire(self, seq: Sequence, trigger: str, rule: str) -> None:
        src = seq.state
        seq.trigger(trigger)
        self.trace.record(TraceEvent(self.tick, seq.seq_id, src, seq.state, trigger, rule,
                                     self.clock()))
        if seq.state in self.lifecycle.terminal:
            self.machine.remove_model(seq)
            del self._live[seq.seq_id]

    def _raise(self, violations: list) -> None:  # type: ignore[type-arg]
        if violations:
            raise InvariantViolation(violations)
