"""A tick's latency budget for a policy with `tick_budget_ms`: how many prompt tokens its slice
may hold, and which ticks probe the streams' pace.

The target is the policy's `tick_budget_ms` over `decode_step_ms`, the rows' plain decode step
as it runs now: its p95 measured before the prompt was parked (`CostModel.decode_step_p95_s`),
times how much slower their step has grown since (`DecodePace`, from probe ticks that run the
decode rows in a forward of their own). The slice is the largest the cost model predicts fits
it (`CostModel.slice_tokens_within`); on a probe tick, the largest that fits, in a forward of
its own, in what the rows' own forward leaves of it, as the last probes measured that forward
(`DecodePace.probe_s`; a 1-token slice there wasted ~3% of the prompt's ticks, and one sized
after the rows' pipelined step ran probe ticks to 1.10x their target at the median, 1.35x at
the 95th percentile, against 0.97x and 1.17x then: in-process, 4 streams and a 10,000-token
prompt), less the rest of a probe tick as the last probes measured it (its time outside its
two forwards: scheduling, sizing, publishing, ~1-2 ms, which a mixed tick's price includes but
neither forward's does). Every tick, budgeted or not, is priced by the cost model afterwards,
except a probe: its two forwards are not the tick the model prices; its slices' forward is
priced as a tick of its own (a slice with no decode rows), so the model learns what the probe's
slice costs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from runtime.budget import CostModel, DecodePace, SliceShape, TickShape
from runtime.executor import Executor, SliceWork
from statemachine.tick import Policy, TickState

_REST_PROBES = 8  # the recent probe ticks whose time outside their forwards is the next's


class TickBudget:
    """One engine's cost model, pace and this tick's target. The engine thread calls it: `begin`
    at the start of each tick, `slice_tokens` from the scheduler (the policy's budget), `shape`
    and `observe` around the tick, `observe_probe` and `observe_probe_slices` with a probe's
    two forwards."""

    def __init__(self, policy: Policy, executor: Executor, chunk: int) -> None:
        self.costs = CostModel()
        self.pace = DecodePace()
        self._policy, self._executor, self._chunk = policy, executor, chunk
        self._tick = 0
        self.target_s: float | None = None  # the latency target this tick's slice is sized for
        # This tick's decode rows and the keys they attend, when it probes their pace.
        self.probe: tuple[list[int], int] | None = None
        # A probe tick's forwards' seconds as measured (the rows', the slices'), and the rest
        # of the recent probe ticks: their time outside both.
        self._probe_parts: list[float] = []
        self._probe_rest: deque[float] = deque(maxlen=_REST_PROBES)

    def begin(self, tick: int) -> None:
        """Tick `tick` starts: nothing sized or probed yet."""
        self._tick, self.target_s, self.probe = tick, None, None
        self._probe_parts = []

    def slice_tokens(self, state: TickState) -> int:
        """Prefill tokens of one slice that fit this tick's target next to the decode rows (0:
        nothing measured yet; the policy's min slice then applies). On a tick that probes the
        rows' pace, the slice runs after their forward, in its own."""
        expr, ex = self._policy.spec.tick_budget_ms, self._executor
        if not state.num_decoding or not state.parked or expr is None:
            return self._chunk
        ids, rows = self._rows()
        if self.pace.due(ids, self._tick):
            self.probe = ids, sum(c + 1 for c in rows)
        constrained = ex.num_constrained_decoding()
        decode_s = self._set_target(ids, rows, constrained)
        if decode_s is None:
            return 0
        assert self.target_s is not None
        context = max(ex.num_cached(p.seq_id) for p in state.parked)
        if self.probe is not None:
            # The rows' own forward first, then the slice in a forward of its own, sized for
            # what is left of the target: after what the last probes' forwards took (a forward
            # of the rows alone cannot queue the next ahead, and sized after their pipelined
            # step's p95, probe ticks ran to 1.1x their target at the median, half of the
            # slowest ticks), or that step's p95 before any probe.
            rows_s = max(decode_s, self.pace.probe_s(ids) or 0.0)
            rest_s = float(np.median(self._probe_rest)) if self._probe_rest else 0.0
            return self.costs.slice_tokens_within(self.target_s - rows_s - rest_s, [], context,
                                                  self._chunk)
        return self.costs.slice_tokens_within(self.target_s, rows, context, self._chunk,
                                              constrained)

    def lane_tokens(self, state: TickState) -> int:
        """A lane policy's budget (ADR 0016): its lane's slice, with this tick's target set for
        the decode rows' pace beside it (none before their step was measured: they step
        unpaced). No probe: the rows' steps beside the lane are not their own pace."""
        spec = self._policy.spec
        assert spec.lane is not None and spec.tick_budget_ms is not None
        if state.num_decoding and state.parked:
            self._set_target(*self._rows(), self._executor.num_constrained_decoding())
        return int(spec.lane.chunk_tokens(self._policy.params))

    def _rows(self) -> tuple[list[int], list[int]]:
        # The decode rows' ids and their contexts.
        decoding = self._executor.decode_rows()
        return [i for i, _ in decoding], [c for _, c in decoding]

    def _set_target(self, ids: list[int], rows: list[int], constrained: int) -> float | None:
        # The rows' step as it runs now (its p95 before the prompt, grown as the probes since
        # measured), with this tick's target set from it; None, and no target, where nothing
        # is known of the step yet (a fit of slice ticks alone prices it at 0 s).
        expr = self._policy.spec.tick_budget_ms
        assert expr is not None
        decode_s = self.costs.decode_step_p95_s(rows, constrained)
        if not decode_s:
            return None
        decode_s *= self.pace.growth(ids)
        self.target_s = expr({**self._policy.params, "decode_step_ms": decode_s * 1e3}) / 1e3
        return decode_s

    def lane_period_s(self) -> float:
        """The decode rows' least period beside the lane this tick (0: unpaced)."""
        lane = self._policy.spec.lane
        assert lane is not None
        return (self.target_s or 0.0) * float(lane.pace(self._policy.params))

    def shape(self, prefills: Sequence[SliceWork], decode: Sequence[int]) -> TickShape:
        """What a tick that runs these slices and decode rows is, as the cost model sees it."""
        ex = self._executor
        decode = [s for s in decode if s in ex]
        prefills = [w for w in prefills if w.seq_id in ex]
        # Rows a grammar masks: constrained decode rows and constrained prompts this tick ends.
        constrained = sum(ex.is_constrained(s) for s in decode) + sum(
            ex.is_constrained(w.seq_id) for w in prefills if w.num_tokens >= ex.prompt_left(
                w.seq_id))
        return TickShape(tuple(ex.num_cached(s) for s in decode),
                         tuple(SliceShape(w.num_tokens, ex.num_cached(w.seq_id))
                               for w in prefills), constrained)

    def observe(self, shape: TickShape, seconds: float) -> None:
        """The tick ran `shape` in `seconds`."""
        if self.probe is None:
            self.costs.observe(shape, seconds, self.target_s)
        elif len(self._probe_parts) == 2:  # both forwards measured: what the rest took
            self._probe_rest.append(max(0.0, seconds - sum(self._probe_parts)))

    def observe_probe_slices(self, shape: TickShape, seconds: float) -> None:
        """This tick's probe: its slices' forward of their own ran `shape` in `seconds`. The cost
        model learns from it as from any tick without decode rows: it sizes the next probe's
        slice, and it is a slice's cost measured without the rows' beside it."""
        self.costs.observe(shape, seconds)
        self._probe_parts.append(seconds)

    def observe_probe(self, seconds: float) -> None:
        """This tick's probe: its decode rows' own forward took `seconds`."""
        assert self.probe is not None
        rows, keys = self.probe
        self.pace.observe(rows, seconds, keys)
        self._probe_parts.append(seconds)
