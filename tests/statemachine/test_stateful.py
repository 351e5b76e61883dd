"""Hypothesis stateful tests over the real scheduler core, beyond the exhaustive bounds."""

import pytest
from hypothesis.stateful import run_state_machine_as_test

from statemachine.spec import shipped_policy_names
from statemachine.stateful import make_machine, run_stateful, stateful_settings
from statemachine.tick import make_policy


@pytest.mark.parametrize("name", [n for n in shipped_policy_names() if n != "baseline"])
@pytest.mark.parametrize(("slots", "max_chunks"), [(8, 20), (16, 12)])
def test_claims_hold_on_random_runs(name, slots, max_chunks):
    run_state_machine_as_test(make_machine(make_policy(name), slots, max_chunks),
                              settings=stateful_settings(examples=100, steps=60))


def test_a_planted_fairness_bug_is_found_and_shrunk(variant):
    policy = make_policy(str(variant("mixed_step", pick="fewest_left")))
    failure = run_stateful(policy, slots=4, max_chunks=8, examples=200)
    assert failure is not None
    assert "overtaken" in failure or "parked" in failure
    assert "trace of the shrunk failing run" in failure and "grant" in failure
