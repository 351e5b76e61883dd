"""A lane policy (ADR 0016): its spec is checked, and in a lane tick the decode rows may take
steps past their one, each counted in what they generated, never past their max_tokens and
never past the KV room the tick leaves for everyone's next token."""

from __future__ import annotations

import pytest

from statemachine.lifecycle import Role
from statemachine.scheduler import Scheduler
from statemachine.spec import load_policy
from statemachine.tick import make_policy
from statemachine.world import Layout
from statemachine.yamlsrc import SpecError

LANE = "token_budget_lane"


def lane_scheduler(kv_budget: int | None, max_tokens: int = 20) -> tuple[Scheduler, int]:
    # Two streams decoding, then a prompt parked beside them: the next tick is a lane tick.
    sched = Scheduler(make_policy(LANE), Layout(4, 8, kv_budget=kv_budget), check=True)
    for seq_id in (0, 1):
        sched.submit(seq_id, 4, max_tokens)
    while any(sched.role(s) is not Role.DECODING for s in (0, 1)):
        sched.complete(sched.schedule(lambda _state: 8))
    sched.submit(2, 30, 5)
    return sched, 2


def generated(sched: Scheduler) -> dict[int, int]:
    return {s.seq_id: s.generated for s in sched.world().seqs}


def test_a_lane_tick_counts_the_rows_extra_steps():
    sched, prompt = lane_scheduler(kv_budget=None)
    before = generated(sched)
    plan = sched.schedule(lambda _state: 8)
    assert plan.prefills and plan.decode and sched.extra_room(plan) > 1000
    sched.complete(plan, extra=3)
    after = generated(sched)
    assert after[0] == before[0] + 4 and after[1] == before[1] + 4  # one step and three more
    assert after[prompt] == 0 and sched.record(prompt).prefilled == 8


def test_extra_steps_stop_at_max_tokens_and_finish_the_row():
    sched, _ = lane_scheduler(kv_budget=None, max_tokens=6)
    left = 6 - generated(sched)[0]
    plan = sched.schedule(lambda _state: 8)
    sched.complete(plan, extra=left + 5)
    assert sched.role(0) is None and sched.role(1) is None  # finished at their max_tokens


def test_extra_steps_leave_room_for_everyones_next_token():
    # Room is what the KV budget holds past every sequence's reservation after the tick and
    # one more token for each decoding row, shared among the rows that step.
    sched, _ = lane_scheduler(kv_budget=64)
    plan = sched.schedule(lambda _state: 8)
    room = sched.extra_room(plan)
    reserved = sum(s.kv_reserved("recompute") for s in plan.world.seqs
                   if s.role in (Role.PARKED, Role.PREFILLING, Role.DECODING))
    # After the tick: the rows one token more, the prompt's slice in (its reservation holds).
    assert room == (64 - (reserved + 2) - 2) // 2
    with pytest.raises(ValueError, match=f"at most {room}"):
        sched.complete(plan, extra=room + 1)
    sched.complete(plan, extra=room)  # check=True: capacity holds after it


def test_only_a_lane_tick_takes_extra_steps():
    sched = Scheduler(make_policy("token_budget"), Layout(4, 8), check=True)
    sched.submit(0, 4, 20)
    sched.complete(sched.schedule(lambda _state: 8))
    plan = sched.schedule(lambda _state: 8)
    assert sched.extra_room(plan) == 0
    with pytest.raises(ValueError, match="none in another tick"):
        sched.complete(plan, extra=1)


@pytest.mark.parametrize(("lane", "message"), [
    ("lane: 3", "must be a mapping with chunk_tokens and pace"),
    ("lane: {chunk_tokens: 8}", "lane.pace: is required"),
    ("lane: {chunk_tokens: 8, pace: 1.5}", "must lie in (0, 1]"),
    ("lane: {chunk_tokens: 0, pace: 0.5}", "at least 1"),
    ("lane: {chunk_tokens: 8, pace: 0.5, depth: 2}", "depth"),
])
def test_a_bad_lane_is_refused_naming_the_field(tmp_path, lane, message):
    text = open(load_policy(LANE).file).read()
    start = text.index("lane:\n")
    end = text.index("pick:")
    path = tmp_path / "bad.yaml"
    path.write_text(text[:start] + lane + "\n" + text[end:])
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace("]", r"\]")):
        load_policy(path)


def test_a_lane_needs_a_tick_target(tmp_path):
    text = open(load_policy(LANE).file).read()
    path = tmp_path / "bad.yaml"
    path.write_text(text.replace("tick_budget_ms: itl_factor * decode_step_ms\n", ""))
    with pytest.raises(SpecError, match="needs tick_budget_ms"):
        load_policy(path)
