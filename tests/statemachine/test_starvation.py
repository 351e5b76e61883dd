"""The defect, forbidden: a 19-chunk prompt that arrives while 4 streams decode gets its first
token within the bound its policy's claims give, under every shipped non-baseline policy;
under baseline it never does."""

import pytest

from statemachine.invariants import implied_ttft
from statemachine.lifecycle import Role, Trigger
from statemachine.scheduler import Scheduler
from statemachine.spec import shipped_policy_names
from statemachine.tick import make_policy
from statemachine.world import Layout

CHUNK = 512
PROMPT_CHUNKS = 19
LAYOUT = Layout(max_running=64, chunk_size=CHUNK)  # room for it: no queue, no preemption


def admit_into_busy_batch(policy_name, max_ticks):
    policy = make_policy(policy_name)
    sched = Scheduler(policy, LAYOUT, check=policy_name != "baseline")
    for seq_id in range(4):
        sched.submit(seq_id, 8)
    for _ in range(100):  # let the streams start (under baseline only the first ever does)
        sched.complete(sched.schedule())
    streams = [s.seq_id for s in sched.sequences() if sched.role(s.seq_id) is Role.DECODING]
    sched.submit(99, PROMPT_CHUNKS * CHUNK)
    ticks = 0
    while sched.role(99) is not Role.DECODING and ticks < max_ticks:
        plan = sched.schedule()
        assert set(plan.decode) <= {*streams, 99}
        sched.complete(plan)  # the decoding streams never finish: the worst case
        ticks += 1
    return sched, streams, ticks


@pytest.mark.parametrize("name", [n for n in shipped_policy_names() if n != "baseline"])
def test_prompt_gets_its_first_token_within_its_claimed_ticks(name):
    sched, streams, ticks = admit_into_busy_batch(name, max_ticks=100_000)
    # With room for it on arrival it queues for no tick and is never preempted, so its claims
    # bound the ticks to its first token by the wait bound alone.
    bound = implied_ttft(PROMPT_CHUNKS, sched.bounds().wait_ticks, 0, 0)
    assert len(streams) == 4
    assert sched.role(99) is Role.DECODING
    assert ticks <= bound
    assert all(sched.role(s) is Role.DECODING for s in streams)  # they were still decoding


def test_baseline_never_grants_the_prompt():
    sched, streams, ticks = admit_into_busy_batch("baseline", max_ticks=2000)
    assert ticks == 2000 and streams
    assert sched.role(99) is Role.PARKED
    assert sched.record(99).prefilled == 0
    assert not [e for e in sched.trace.events()
                if e["seq"] == 99 and e["trigger"] == Trigger.GRANT.value]
