"""The tick cost model with rows a grammar masks, against synthetic machines (as in
test_budget.py): the true cost of a tick adds a per-row cost for each constrained row (computing
and applying its mask), which the model must learn and predict, and size slices by."""

from __future__ import annotations

import random

from runtime.budget import CostModel, SliceShape, TickShape
from tests.runtime.test_budget import Machine, largest_fitting, machine, noisy

PER_CONSTRAINED_ROW = 0.0015  # s: above a free row's whole cost, as a large schema's mask is


def with_masks(truth: Machine, per_row: float = PER_CONSTRAINED_ROW) -> Machine:
    return lambda shape: truth(shape) + per_row * shape.constrained_rows


def random_tick(rng: random.Random) -> TickShape:
    rows = tuple(rng.randrange(0, 6000) for _ in range(rng.choice([0, 1, 4, 8, 16])))
    slices = tuple(SliceShape(rng.choice([1, 8, 32, 64, 128, 256, 512]), rng.randrange(0, 8000))
                   for _ in range(rng.choice([0, 1, 1, 2])))
    if not rows and not slices:
        rows = (100,)
    return TickShape(rows, slices, rng.randint(0, len(rows)))


def trained(truth: Machine, ticks: int = 300, seed: int = 0) -> CostModel:
    rng = random.Random(seed)
    model, measure = CostModel(), noisy(truth, rng, 0.1)
    for _ in range(ticks):
        shape = random_tick(rng)
        seconds = measure(shape)
        model.observe(shape, seconds, target_s=seconds * 1.25)
    return model


def test_constrained_rows_are_predicted_within_the_noise():
    truth = with_masks(machine())
    model = trained(truth)
    rng = random.Random(7)
    errors = sorted(abs(model.predict_s(s) / truth(s) - 1)
                    for s in (random_tick(rng) for _ in range(200)))
    assert errors[len(errors) // 2] < 0.05
    assert errors[int(len(errors) * 0.95)] < 0.15


def test_the_decode_step_with_every_row_constrained_costs_what_the_masks_add():
    truth = with_masks(machine())
    model = trained(truth)
    rows = (2000,) * 16
    for constrained in (0, 1, 16):
        want = truth(TickShape(rows, (), constrained))
        got = model.predict_s(TickShape(rows, (), constrained))
        assert abs(got / want - 1) < 0.1, (constrained, got, want)
    step = model.decode_step_p95_s(rows, 16)
    assert step is not None and step >= truth(TickShape(rows, (), 16)) * 0.95
    free = model.decode_step_p95_s(rows)
    assert free is not None and step - free > 16 * PER_CONSTRAINED_ROW * 0.7


def test_slices_beside_constrained_rows_fit_their_target():
    truth = with_masks(machine())
    model = trained(truth)
    rows = (500,) * 16
    target = truth(TickShape(rows, (), 16)) * 2.0
    for context in (0, 4000):
        got = model.slice_tokens_within(target, rows, context, most=512, constrained_rows=16)
        assert truth(TickShape(rows, (SliceShape(got, context),), 16)) <= target * 1.1
        # Sized as if the rows were free, the slice would overshoot: the masks' time is counted.
        free = largest_fitting(machine(), rows, context, target)
        best = largest_fitting(lambda s: truth(TickShape(s.decode_contexts, s.slices, 16)),
                               rows, context, target)
        assert best < free and got <= best * 1.1 + 1
        assert got >= 0.6 * best


def test_a_machine_without_masks_learns_no_mask_cost():
    model = trained(machine())
    rows = (1000,) * 16
    free, masked = (model.predict_s(TickShape(rows, (), c)) for c in (0, 16))
    assert abs(masked / free - 1) < 0.05
