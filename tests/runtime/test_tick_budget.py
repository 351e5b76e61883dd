"""A tick's slice sized by `TickBudget` over a real executor (the built-in model): on a tick that
probes the streams' pace, the slice gets what the rows' own forward leaves of the target; and
there is no target while nothing is known of the rows' step."""

from __future__ import annotations

import pytest

from runtime.budget import CostModel, SliceShape, TickShape
from runtime.executor import Executor
from runtime.model import ModelBundle
from runtime.sampling import SamplingParams
from runtime.tick_budget import TickBudget
from statemachine.tick import ParkedPrefill, TickState, make_policy

STEP_S = 0.004  # the rows' decode step, as the cost model sees it before the prompt comes
CHUNK = 512


def machine_s(shape: TickShape) -> float:
    """A machine's tick: 2 ms, 1 ms a decode row, 1 ms a slice, 0.1 ms a slice token and 10 ns
    a key a slice token attends (a decode-only tick of two rows: STEP_S)."""
    rows = len(shape.decode_contexts)
    return 0.002 + 0.001 * rows + sum(
        0.001 + s.num_tokens * (1e-4 + 1e-8 * (s.context + (s.num_tokens + 1) / 2))
        for s in shape.slices)


def budget_with_parked_prompt(bundle: ModelBundle) -> tuple[TickBudget, TickState]:
    """Two decoding rows and a parked prompt on a real executor, and a cost model that has seen
    this machine's decode-only ticks, slice ticks, and mixed ticks well within their target."""
    ex = Executor(bundle)
    for seq_id in (0, 1):
        prompt = list(range(40 + seq_id, 60 + seq_id))
        ex.add(seq_id, prompt, SamplingParams(max_tokens=100))
        ex.prefill(seq_id, len(prompt))
    ex.add(2, list(range(50, 650)), SamplingParams(max_tokens=1))
    ex.prefill(2, 100)
    budget = TickBudget(make_policy("token_budget"), ex, CHUNK)
    rows = (20, 21)
    assert machine_s(TickShape(rows)) == pytest.approx(STEP_S)
    for _ in range(16):
        budget.costs.observe(TickShape(rows), STEP_S)
    for tokens in (1, 2, 4, 8, 16, 32, 64, 128) * 4:
        for shape in (TickShape((), (SliceShape(tokens, 100),)),
                      TickShape(rows, (SliceShape(tokens, 100),))):
            budget.costs.observe(shape, machine_s(shape), target_s=1.0)
    state = TickState(max_running=4, num_running=3, num_decoding=2,
                      parked=(ParkedPrefill(seq_id=2),), chunk_size=CHUNK)
    return budget, state


def probe_slices(budget: TickBudget, state: TickState, probe_s: float, ticks: int,
                 rest_s: float | None = None) -> list[int]:
    """The slice of each parked tick that probes, each probe's rows' forward taking `probe_s`;
    with `rest_s`, its slices' forward takes what this machine takes and the whole tick that
    plus `rest_s` more."""
    slices = []
    for tick in range(ticks):
        budget.begin(tick)
        tokens = budget.slice_tokens(state)
        if budget.probe is not None:
            slices.append(tokens)
            budget.observe_probe(probe_s)
            if rest_s is not None:
                shape = TickShape((), (SliceShape(tokens, 100),))
                budget.observe_probe_slices(shape, machine_s(shape))
                budget.observe(TickShape((20, 21), shape.slices),
                               probe_s + machine_s(shape) + rest_s)
    return slices


def test_a_probe_slice_gets_what_the_rows_own_forward_leaves_of_the_target(bundle):
    # The rows' own forward cannot queue the next step ahead: it takes longer than their
    # pipelined step. A probe sized after the step overshot its target.
    quick, slow = budget_with_parked_prompt(bundle), budget_with_parked_prompt(bundle)
    at_step = probe_slices(*quick, probe_s=STEP_S, ticks=40)
    at_twice = probe_slices(*slow, probe_s=2 * STEP_S, ticks=40)
    assert len(at_step) == len(at_twice) > 6
    # The first probe, before any was measured: sized after the step in both.
    assert at_step[0] == at_twice[0] > 0
    # Then after what the probes measured: less room when the rows' forward takes longer.
    assert all(a > b for a, b in zip(at_step[1:], at_twice[1:], strict=True))
    # The probe tick then fits its target on this machine: the rows' forward and the slice's.
    target = slow[0].target_s
    assert target == pytest.approx(4 * STEP_S)
    assert all(2 * STEP_S + machine_s(TickShape((), (SliceShape(n, 100),))) <= target
               for n in at_twice[1:])
    assert min(at_twice[1:]) > 1


def test_a_probe_slice_leaves_room_for_what_the_tick_takes_outside_its_forwards(bundle):
    # The engine schedules, sizes and publishes around a probe's two forwards: ~1-2 ms that a
    # mixed tick's price includes but neither forward's does.
    bare, busy = budget_with_parked_prompt(bundle), budget_with_parked_prompt(bundle)
    rest_s = STEP_S / 2
    without = probe_slices(*bare, probe_s=STEP_S, ticks=60, rest_s=0.0)
    with_rest = probe_slices(*busy, probe_s=STEP_S, ticks=60, rest_s=rest_s)
    assert without[0] == with_rest[0]  # nothing measured of the rest yet
    assert all(a > b > 1 for a, b in zip(without[1:], with_rest[1:], strict=True))
    target = busy[0].target_s
    assert all(STEP_S + rest_s + machine_s(TickShape((), (SliceShape(n, 100),))) <= target
               for n in with_rest[1:])


def test_a_probe_whose_rows_take_the_whole_target_leaves_the_slice_nothing(bundle):
    budget, state = budget_with_parked_prompt(bundle)
    slices = probe_slices(budget, state, probe_s=5 * STEP_S, ticks=40)
    assert slices[0] > 0 and slices[1:] == [0] * (len(slices) - 1)


def test_no_target_while_the_rows_step_is_priced_at_nothing(bundle):
    # Right after start-up the cost model may have seen only slice ticks, each costing its
    # tokens' time: its fit prices a decode step at 0 s. That is no target (a target of 0 s
    # made the engine divide by it when timing the tick against it, and the engine died).
    budget, state = budget_with_parked_prompt(bundle)
    budget.costs = CostModel()
    for tokens in (4, 8, 16, 32) * 3:
        budget.costs.observe(TickShape((), (SliceShape(tokens, 0),)), 5e-4 * tokens)
    assert budget.costs.decode_step_p95_s((20, 21)) == 0.0
    budget.begin(0)
    assert budget.slice_tokens(state) == 0  # the policy's min slice then applies
    assert budget.target_s is None
