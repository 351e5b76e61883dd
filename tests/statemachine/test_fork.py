"""Sibling choices (`n` > 1): born decoding on the prompt's KV where an arrival would be admitted,
refused (the caller queues them as arrivals) where it would not, and visible in the trace."""

import pytest

from statemachine.lifecycle import Role
from statemachine.scheduler import Scheduler
from statemachine.tick import make_policy
from statemachine.world import Layout
from tests.lifecycle_names import DECODING, FORK, WAITING

PROMPT = 6


def first_token(sched: Scheduler, seq_id: int) -> None:
    """Run ticks until `seq_id` has its first token (and nothing more)."""
    while sched.record(seq_id).generated == 0:
        sched.complete(sched.schedule())


def test_a_sibling_is_born_decoding_with_the_prompts_kv_and_its_first_token():
    sched = Scheduler(make_policy("default"), Layout(4, 4, kv_budget=64), check=True)
    sched.submit(0, PROMPT, 5)
    first_token(sched, 0)
    assert sched.fork(1, 0, PROMPT, 5)
    child = sched.record(1)
    assert child.role is Role.DECODING and child.generated == 1
    assert child.kv_cached == PROMPT == sched.record(0).kv_cached
    fork = [e for e in sched.trace.events() if e["seq"] == 1]
    assert [(e["from"], e["to"], e["trigger"], e["rule"]) for e in fork] == \
        [(WAITING, DECODING, FORK, "fork of 0")]
    plan = sched.schedule()
    assert set(plan.decode) == {0, 1}  # it decodes beside its parent from the next tick
    sched.complete(plan)
    while sched.sequences():  # both run to max_tokens under the checked invariants
        sched.complete(sched.schedule())


@pytest.mark.parametrize(("running", "budget", "queued_prompt"), [
    (2, 64, None),  # no running place
    (4, 2 * PROMPT + 4, None),  # no KV room
    (4, 28, 17),  # room, but an arrival that does not fit yet waits first in line
], ids=["running limit", "kv budget", "queued arrival"])
def test_a_sibling_that_an_arrival_could_not_join_is_refused(running, budget, queued_prompt):
    sched = Scheduler(make_policy("default"), Layout(running, 4, kv_budget=budget), check=True)
    sched.submit(0, PROMPT, 5)
    sched.submit(1, 1, 5)
    first_token(sched, 0)
    if queued_prompt is not None:
        sched.submit(2, queued_prompt, 5)
        sched.complete(sched.schedule())
        assert sched.role(2) is Role.QUEUED
    before = sched.world()
    assert not sched.fork(3, 0, PROMPT, 5)
    assert sched.world() == before and sched.role(3) is None
    if queued_prompt is not None:
        sched.abort(2)  # without it the same sibling fits: the queue was the reason
        assert sched.fork(3, 0, PROMPT, 5)


def test_a_sibling_of_a_prompt_that_finished_with_its_first_token():
    sched = Scheduler(make_policy("default"), Layout(4, 4, kv_budget=64), check=True)
    sched.submit(0, PROMPT, 1)
    sched.complete(sched.schedule())
    sched.complete(sched.schedule())
    assert sched.role(0) is None  # finished at max_tokens 1
    assert sched.fork(1, 0, PROMPT, 1)
    assert sched.finish(1)  # the engine finishes it the same way at its first token


def test_fork_ids_must_increase():
    sched = Scheduler(make_policy("default"), Layout(4, 4))
    sched.submit(5, PROMPT, 3)
    with pytest.raises(ValueError, match="must increase"):
        sched.fork(4, 5, PROMPT, 3)
