"""The scheduler core: owns the sequence models and applies the step function to them.

No MLX here. Each tick is two calls around the executor: `schedule()` runs `begin_tick` (KV
room, admission, `decide_tick`, grants) and returns its Plan; `complete()` runs `end_tick` on
what ran, then finishes the sequences the executor ended. Between ticks a sequence may be
aborted or finished, and a sibling choice forked from a prompt that just gave its first token.
Every change is the step function's (statemachine.world), applied to the models by firing the
lifecycle's triggers on the one shared Machine (which refuses an edge the spec does not
declare) and recorded in the trace.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

from statemachine.invariants import (
    Bounds,
    ClaimConfig,
    InvariantViolation,
    Violation,
    check_capacity,
    check_claims,
    check_decision,
)
from statemachine.lifecycle import Lifecycle, Role, Trigger, load_lifecycle
from statemachine.sequence import SeqModel
from statemachine.tick import Policy, TickState
from statemachine.trace import TraceEvent, TraceLog
from statemachine.world import (
    Budget,
    Event,
    Layout,
    Outcome,
    Plan,
    Seq,
    World,
    admissible,
    begin_tick,
    end_tick,
    extra_room,
    fork,
    lane_tick,
    leave,
    new_seq,
    tick_state,
)


class Scheduler:
    """The declarative scheduler over live sequences; see the module docstring."""

    def __init__(self, policy: Policy, layout: Layout, lifecycle: Lifecycle | None = None,
                 trace: TraceLog | None = None, check: bool = False,
                 clock: Callable[[], float] = time.monotonic, horizon: int = 2**62,
                 claims: tuple[ClaimConfig, int] | None = None) -> None:
        self.policy, self.layout = policy, layout
        self.lifecycle = lifecycle or load_lifecycle()
        if layout.kv_budget is not None:
            require_kv_roles(self.lifecycle, policy)
        self.machine = self.lifecycle.make_machine()
        self.trace = trace if trace is not None else TraceLog()
        self.check, self.clock, self.horizon = check, clock, horizon
        self.tick = 0
        self._world = World()  # the records, in arrival order; the models hold the states
        self._live: dict[int, SeqModel] = {}
        self._names: dict[int, str] = {}  # seq -> the request id the trace shows
        self._most = {"seqs": 1, "chunks": 1, "tokens": 1, "grants": 1, "max_tokens": 0,
                      "unlimited": 0}
        self._bounds: dict[tuple[int, ...], Bounds] = {}
        if claims is not None:  # a fixed configuration (and most grants) to check claims for
            self._fixed: Bounds | None = Bounds.of(policy, claims[0], claims[1], horizon)
        else:
            self._fixed = None

    # -- requests in -------------------------------------------------------------------
    def submit(self, seq_id: int, prompt_tokens: int, max_tokens: int | None = None,
               request_id: str | None = None, cached: int = 0) -> SeqModel:
        """Queue a new sequence; ValueError if it could never run in this layout.
        `request_id` names it in the trace; its first `cached` prompt tokens came from the
        prefix cache (it holds their KV already and prefills only the rest)."""
        if seq_id in self._live or (self._live and seq_id < max(self._live)):
            raise ValueError(f"sequence ids must increase: {seq_id} after {max(self._live)}")
        problem = admissible(prompt_tokens, max_tokens, self.layout.kv_budget)
        if problem is not None:
            raise ValueError(problem)
        rec = new_seq(seq_id, prompt_tokens, max_tokens, cached)
        model = self._join(rec, request_id)
        self._world = self._world._replace(seqs=(*self._world.seqs, rec))
        self.trace.record(TraceEvent(self.tick, seq_id, None, model.state, "arrive", "arrival",
                                     self.clock(), request_id, "arrival",
                                     self.lifecycle.role_of[model.state].word,
                                     cached_tokens=cached))
        return model

    def fork(self, seq_id: int, parent_id: int, prompt_tokens: int,
             max_tokens: int | None = None, request_id: str | None = None) -> bool:
        """A sibling choice of `parent_id`, whose prompt gave its first token in the tick just
        completed: True if it was born decoding on a copy of that prompt's KV (the trace shows
        `fork`), False if it does not fit now (nothing changed: submit it as an arrival that
        prefills the prompt itself). The parent may have finished already."""
        if seq_id in self._live or (self._live and seq_id < max(self._live)):
            raise ValueError(f"sequence ids must increase: {seq_id} after {max(self._live)}")
        problem = admissible(prompt_tokens, max_tokens, self.layout.kv_budget)
        if problem is not None:
            raise ValueError(problem)
        forked = fork(self._world, seq_id, prompt_tokens, max_tokens, self.policy.spec.kv_full,
                      self.lifecycle, self.layout, f"fork of {parent_id}")
        if forked is None:
            return False
        world, event = forked
        self._join(event.rec, request_id)
        self._world = world
        self._apply((event,), self.tick - 1)
        return True

    def abort(self, seq_id: int) -> bool:
        """Abort a live sequence at once (between ticks); False if it is not live."""
        return self._leave(seq_id, Trigger.ABORT)

    def finish(self, seq_id: int) -> bool:
        """A decoding sequence ended (a stop token or string); False if it is not live."""
        return self._leave(seq_id, Trigger.FINISH)

    # -- one tick ------------------------------------------------------------------------
    def schedule(self, budget: Budget | None = None) -> Plan:
        """Make room, admit, decide, grant. The caller runs the plan, then calls `complete`.
        `budget` gives the prefill tokens that fit this tick's latency target."""
        plan = begin_tick(self._world, self.policy, self.lifecycle, self.layout, budget)
        self._world = plan.world
        self._apply(plan.events)
        # Why the queued still wait: no running place, or no KV room (admission is in order;
        # a paused sequence waits for KV room to decode again).
        full = plan.state.num_running >= self.layout.max_running
        for role, why in ((Role.QUEUED, "running_limit" if full else "kv_budget"),
                          (Role.PREEMPTED, "running_limit" if full else "kv_budget"),
                          (Role.PAUSED, "kv_budget")):
            self._waited([s.seq_id for s in plan.world.seqs if s.role is role], why)
        if self.check:
            self._raise(check_decision(plan.state, plan.decision))
        return plan

    def extra_room(self, plan: Plan) -> int:
        """The decode rows' steps past their one that a lane tick of `plan` may take (0 in any
        other tick): `statemachine.world.extra_room`."""
        if not lane_tick(plan, self.policy):
            return 0
        return extra_room(self._current(plan), self.lifecycle, self.policy.spec.kv_full,
                          self.layout)

    def complete(self, plan: Plan, finished: Collection[int] = (), extra: int = 0) -> Outcome:
        """Apply the outcome of `plan`, then finish the sequences in `finished`. `extra`: the
        decode rows' steps past their one, in a lane tick (at most `extra_room(plan)`)."""
        if extra and not 0 < extra <= self.extra_room(plan):
            raise ValueError(f"{extra} extra decode steps: a lane tick may take at most "
                             f"{self.extra_room(plan)} (none in another tick)")
        # Sequences that left since `schedule` (an abort, a failure) are gone from the world.
        outcome = end_tick(self._current(plan), self.lifecycle, extra)
        self._world = outcome.world
        self._apply(outcome.events)
        granted = set(plan.decision.granted)
        self._waited([s.seq_id for s in outcome.world.seqs
                      if s.role is Role.PARKED and s.seq_id not in granted],
                     plan.decision.rule)
        for _, _, grants in outcome.completed:
            self._most["grants"] = max(self._most["grants"], grants)
        self.tick += 1
        if self.check:
            self._raise(check_capacity(outcome.world.seqs, self.layout)
                        + check_claims(outcome, self.bounds()))
        for seq_id in finished:
            model = self._live.get(seq_id)
            if model is not None and self.lifecycle.role_of[model.state] is Role.DECODING:
                self._leave(seq_id, Trigger.FINISH, self.tick - 1)
        return outcome

    def _current(self, plan: Plan) -> Plan:
        # `plan` over the world as it is now (sequences that left since `schedule` are gone).
        return Plan(self._world, plan.state, plan.decision, plan.prefills, plan.decode,
                    plan.events)

    # -- derived views ---------------------------------------------------------------------
    def world(self) -> World:
        """The sequences as records, in arrival order. Each record's role is its model's state:
        every change fires the model's trigger, and the Machine must agree (checked)."""
        return self._world

    def record(self, seq_id: int) -> Seq | None:
        """The sequence's token counts and counters."""
        return next((s for s in self._world.seqs if s.seq_id == seq_id), None)

    def tick_state(self) -> TickState:
        """The snapshot a policy would decide on now (before admission)."""
        world = self.world()
        return tick_state(world.seqs, world, self.layout)

    def role(self, seq_id: int) -> Role | None:
        model = self._live.get(seq_id)
        return None if model is None else self.lifecycle.role_of[model.state]

    def sequence(self, seq_id: int) -> SeqModel | None:
        return self._live.get(seq_id)

    def sequences(self) -> list[SeqModel]:
        """The live sequences, in arrival order."""
        return list(self._live.values())

    def bounds(self) -> Bounds:
        """The policy's claims for this layout and the largest requests seen so far (or for
        the fixed configuration it was given)."""
        if self._fixed is not None:
            return self._fixed
        m = self._most
        key = (m["seqs"], m["chunks"], m["tokens"], m["grants"], m["max_tokens"],
               m["unlimited"])
        if key not in self._bounds:
            cfg = ClaimConfig(self.layout.max_running, m["seqs"], m["chunks"], m["tokens"],
                              None if m["unlimited"] else m["max_tokens"])
            self._bounds[key] = Bounds.of(self.policy, cfg, max(m["grants"], m["chunks"]),
                                          self.horizon)
        return self._bounds[key]

    # -- internals -----------------------------------------------------------------------
    def _join(self, rec: Seq, request_id: str | None) -> SeqModel:
        # A new model, at the lifecycle's initial state; the claims' sizes grow to include it.
        model = SeqModel(rec)
        self.machine.add_model(model, initial=self.lifecycle.initial)
        self._live[rec.seq_id] = model
        if request_id is not None:
            self._names[rec.seq_id] = request_id
        chunks = -(-rec.prompt_len // self.layout.chunk_size)
        for key, value in (("seqs", len(self._live)), ("chunks", chunks),
                           ("tokens", rec.prompt_len), ("max_tokens", rec.max_tokens or 0),
                           ("unlimited", rec.max_tokens is None)):
            self._most[key] = max(self._most[key], value)
        return model

    def _leave(self, seq_id: int, trigger: Trigger, tick: int | None = None) -> bool:
        if seq_id not in self._live:
            return False
        self._world, event = leave(self._world, seq_id, trigger, self.lifecycle)
        self._apply((event,), tick)
        return True

    def _apply(self, events: Collection[Event], tick: int | None = None) -> None:
        # Fire each event's trigger on its model: the Machine refuses an edge the spec does not
        # declare, and must land where the step function did.
        for e in events:
            model = self._live[e.seq_id]
            model.rec = e.rec  # what the edge's guards read
            src = model.state
            model.trigger(e.trigger.value)
            role = self.lifecycle.role_of[model.state]
            if role is not e.dst:
                raise AssertionError(f"the machine moved seq {e.seq_id} to {role}, the step "
                                     f"function to {e.dst}")
            self.trace.record(TraceEvent(self.tick if tick is None else tick, e.seq_id, src,
                                         model.state, e.trigger.value, e.rule, self.clock(),
                                         self._names.get(e.seq_id), role=role.word))
            if role.terminal:
                self.machine.remove_model(model)
                del self._live[e.seq_id]
                self._names.pop(e.seq_id, None)
                self.trace.left(e.seq_id)
        if self.check:
            for rec in self._world.seqs:
                state = self._live[rec.seq_id].state
                if self.lifecycle.role_of[state] is not rec.role:
                    raise AssertionError(f"seq {rec.seq_id} is {state!r} in the machine but "
                                         f"{rec.role.word} in the step function")

    def _waited(self, seq_ids: list[int], rule: str) -> None:
        # Compressed into runs by the trace: a long wait is a few events, not one a tick.
        now = self.clock()
        for seq_id in seq_ids:
            state = self._live[seq_id].state
            self.trace.waited(seq_id, self._names.get(seq_id), state,
                              self.lifecycle.role_of[state].word, rule, self.tick, now)

    def _raise(self, violations: list[Violation]) -> None:
        if violations:
            raise InvariantViolation(violations)


def require_kv_roles(lifecycle: Lifecycle, policy: Policy) -> None:
    """A policy that preempts under a KV budget needs the lifecycle's preemption states."""
    if policy.spec.kv_full == "recompute":
        lifecycle.require((Role.PREEMPTED,), f"kv_full: recompute (policy {policy.name})")
    elif policy.spec.kv_full == "pause":
        lifecycle.require((Role.PAUSED, Role.PREEMPTED), f"kv_full: pause (policy {policy.name})")
