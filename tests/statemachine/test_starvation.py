"""The defect, forbidden: a 19-chunk prompt admitted while 4 sequences decode completes within
its claimed ticks under every shipped non-baseline policy; under baseline it never does."""

import pytest

from statemachine.scheduler import Scheduler
from statemachine.spec import shipped_policy_names
from statemachine.tick import make_policy

CHUNK = 512
PROMPT_CHUNKS = 19


def admit_into_busy_batch(policy_name, max_ticks):
    policy = make_policy(policy_name)
    sched = Scheduler(policy, num_slots=5, chunk_size=CHUNK,
                      check=policy_name != "baseline")
    for seq_id in range(4):
        sched.submit(seq_id, 8)
    for _ in range(100):  # let the streams start (under baseline only the first ever does)
        sched.complete(sched.schedule())
    streams = [s for s in sched.sequences() if s.state == "decoding"]
    sched.submit(99, PROMPT_CHUNKS * CHUNK)
    ticks = 0
    while sched.sequence(99).state != "decoding" and ticks < max_ticks:
        plan = sched.schedule()
        assert set(plan.decode) <= {s.seq_id for s in streams} | {99}
        sched.complete(plan)  # the decoding streams never finish: the worst case
        ticks += 1
    return sched, streams, ticks


@pytest.mark.parametrize("name", [n for n in shipped_policy_names() if n != "baseline"])
def test_prompt_completes_within_its_claimed_ticks(name):
    bound = make_policy(name).claim("ttft_ticks", slots=5, chunks=PROMPT_CHUNKS,
                                    max_chunks=PROMPT_CHUNKS)
    sched, streams, ticks = admit_into_busy_batch(name, max_ticks=10 * bound)
    assert len(streams) == 4
    assert sched.sequence(99).state == "decoding"
    assert ticks <= bound
    assert all(s.state == "decoding" for s in streams)  # they were still decoding


def test_baseline_never_grants_the_prompt():
    sched, streams, ticks = admit_into_busy_batch("baseline", max_ticks=2000)
    assert ticks == 2000 and streams
    assert sched.sequence(99).state == "parked_prefill"
    assert sched.sequence(99).prefill_left == PROMPT_CHUNKS * CHUNK
    assert not [e for e in sched.trace.events() if e["seq"] == 99 and e["trigger"] == "grant"]
