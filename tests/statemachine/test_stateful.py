"""Hypothesis stateful tests over the real scheduler core, beyond the exhaustive bounds: the
claims hold, every rule of every shipped policy decides ticks, and planted bugs are found."""

import pytest

from statemachine.spec import shipped_policy_names
from statemachine.stateful import Sizes, run_stateful
from statemachine.tick import make_policy

NON_BASELINE = [n for n in shipped_policy_names() if n != "baseline"]


@pytest.mark.parametrize("name", NON_BASELINE)
def test_claims_hold_and_every_rule_fires(name):
    policy = make_policy(name)
    result = run_stateful(policy, examples=100, steps=25, derandomize=True)
    assert result.failure is None, result.failure
    silent = [r.name for r in policy.spec.rules if not result.fired[r.name]]
    assert not silent, f"rules that never decided a tick: {silent}"
    if policy.spec.lane is not None:  # lane ticks whose rows stepped again, and ones that not
        assert result.extra[True] and result.extra[False], result.extra


@pytest.mark.parametrize("name", NON_BASELINE)
def test_claims_hold_with_sibling_choices_forked_at_first_tokens(name):
    # n > 1: siblings born decoding on the prompt's KV where they fit, queued where they don't.
    result = run_stateful(make_policy(name), sizes=Sizes(forks=True, burst=3), examples=40,
                          steps=50, derandomize=True)
    assert result.failure is None, result.failure
    assert result.forks[True] and result.forks[False], result.forks


def test_baseline_starves_at_the_horizon():
    result = run_stateful(make_policy("baseline"), sizes=Sizes(horizon=16, kv_budgets=False),
                          examples=100, steps=25, shrink=False, derandomize=True)
    assert result.failure is not None and "no_starvation" in result.failure


def test_a_wait_claim_one_below_the_truth_is_found_at_eight_running(variant):
    path = variant("mixed_step", claims={"wait_ticks": "max_running - 2"})
    result = run_stateful(make_policy(str(path)), sizes=Sizes(min_running=8, max_running=8,
                                                              kv_budgets=False),
                          examples=200, steps=25, shrink=False, derandomize=True)
    assert result.failure is not None and "wait_ticks" in result.failure
    assert "@reproduce_failure" in result.failure  # print_blob: it can be replayed
    assert "trace of the failing run" in result.failure and "grant" in result.failure


def test_a_pick_rule_that_lets_a_prompt_be_overtaken_is_found_and_shrunk(variant):
    result = run_stateful(make_policy(str(variant("mixed_step", pick="fewest_left"))),
                          sizes=Sizes(min_running=3, max_running=3, max_chunks=6,
                                      chunk_sizes=(1,), kv_budgets=False),
                          examples=200, steps=25, derandomize=True)
    assert result.failure is not None
    assert "overtaken" in result.failure or "parked" in result.failure
    assert result.failure.count(" admit ") <= 12  # shrunk to a handful of sequences
