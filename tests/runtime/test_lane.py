"""The prefill lane's threads and the scheduling class they run in (runtime/lane.py)."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import pytest

from runtime import attention
from runtime.engine_config import EngineConfig
from runtime.lane import PrefillLane

TASKS = Path("/proc/self/task")
pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or not TASKS.is_dir(),
                                reason="Linux's scheduling classes and /proc")


def _threads() -> set[int]:
    return {int(tid) for tid in os.listdir(TASKS)}


def _lane_threads(priority: str) -> tuple[PrefillLane, set[int]]:
    """A lane at `priority` that has run a job on both its streams, and the threads that
    appeared with it (its own and the workers MLX starts for its streams)."""
    before = _threads()
    lane = PrefillLane(priority)

    def work() -> float:
        a = mx.ones((64, 64))
        with mx.stream(attention.second_stream()):
            b = a @ a
        return (a @ a + b).sum().item()

    job = lane.submit(work)
    job.done.wait()
    assert job.error is None and job.result == 2 * 64 ** 3
    return lane, _threads() - before


def test_an_idle_lane_and_the_mlx_workers_it_starts_run_in_sched_idle():
    lane, threads = _lane_threads("idle")
    try:
        assert lane.priority == "idle"
        # The lane's thread and at least one of MLX's stream workers, which inherit its class.
        assert lane._thread.native_id in threads and len(threads) >= 2
        assert {tid: os.sched_getscheduler(tid) for tid in threads} == \
            {tid: os.SCHED_IDLE for tid in threads}
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the thread that made it: unchanged
    finally:
        lane.close()


def test_a_normal_lane_runs_as_every_thread():
    lane, threads = _lane_threads("normal")
    try:
        assert lane.priority == "normal" and len(threads) >= 2
        assert {os.sched_getscheduler(tid) for tid in threads} == {os.SCHED_OTHER}
    finally:
        lane.close()


def test_a_lane_the_system_refuses_sched_idle_runs_as_normal_and_says_why(monkeypatch):
    def refuse(*args: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    lane, threads = _lane_threads("idle")
    try:
        assert lane.priority == "normal (sched_setscheduler refused it: [Errno 1] Operation " \
            "not permitted)"
        assert {os.sched_getscheduler(tid) for tid in threads} == {os.SCHED_OTHER}
    finally:
        lane.close()


def test_an_unknown_priority_is_refused_with_what_is_allowed():
    with pytest.raises(ValueError, match="lane_priority must be one of idle, normal, got 'low'"):
        PrefillLane("low")
    with pytest.raises(ValueError, match="lane_priority must be one of idle, normal, got 'low'"):
        EngineConfig(lane_priority="low")
    assert EngineConfig().lane_priority == "idle"
