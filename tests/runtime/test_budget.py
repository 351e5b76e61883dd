"""The online cost model that sizes token-budget slices."""

import pytest

from runtime.budget import CostModel


def test_nothing_measured_means_no_budget():
    model = CostModel()
    assert model.decode_s(4) is None
    assert model.prefill_tokens_within(0.01, context=0, most=512) == 0


def test_learns_fixed_per_token_and_context_costs():
    model = CostModel()
    o, a, b = 0.001, 0.0005, 2e-7  # the machine's true costs
    for tokens, context in [(16, 0), (64, 100), (32, 900), (128, 2000), (16, 4000), (48, 6000)]:
        model.observe_prefill(tokens, context, o + a * tokens + b * tokens * context)
    assert model.prefill_s(100, 3000) == pytest.approx(o + a * 100 + b * 100 * 3000, rel=1e-6)
    # The slice that fits 10 ms shrinks as the context grows.
    near = model.prefill_tokens_within(0.010, context=0, most=512)
    far = model.prefill_tokens_within(0.010, context=8000, most=512)
    assert near == int((0.010 - o) / a) and 0 < far < near
    assert model.prefill_tokens_within(10.0, context=0, most=512) == 512


def test_decode_cost_is_a_moving_average_per_batch_size():
    model = CostModel()
    model.observe_decode(4, 0.004)
    model.observe_decode(4, 0.009)
    assert 0.004 < model.decode_s(4) < 0.009
    assert model.decode_s(3) == model.decode_s(4)  # the nearest measured size stands in


def test_whole_chunks_alone_do_not_fake_a_fixed_cost():
    # Only 512-token chunks at growing context: no way to separate a per-forward cost, so the
    # model must not invent one and then promise huge slices.
    model = CostModel()
    for context in range(0, 5120, 512):
        model.observe_prefill(512, context, 512 * (0.0006 + 6e-7 * context))
    assert model.prefill_tokens_within(0.010, context=2000, most=512) == int(
        0.010 / (0.0006 + 6e-7 * 2000))
