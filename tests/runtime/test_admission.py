"""The waiting queue's bound and the Retry-After it gives when full (runtime/admission.py)."""

from __future__ import annotations

import time

import pytest

from runtime.admission import RETRY_MAX_S, Admission
from runtime.api import EngineFull


def refused(admission: Admission) -> EngineFull:
    with pytest.raises(EngineFull) as caught:
        admission.reserve()
    return caught.value


def test_a_full_queue_refuses_and_a_place_frees_on_admission():
    admission = Admission(max_waiting=2)
    admission.reserve()
    admission.reserve()
    assert "2 requests are already waiting (--max-waiting 2)" in str(refused(admission))
    admission.admitted(time.monotonic())
    admission.reserve()  # the admitted request's place
    assert admission.num_queued == 2


def test_retry_after_is_the_recent_interval_between_admissions():
    admission = Admission(max_waiting=1)
    admission.reserve()
    assert refused(admission).retry_after_s == 1  # nothing admitted yet: no pace known
    now = time.monotonic()
    for ago in (30.0, 20.0, 10.0):  # one place freed every 10 s
        admission.admitted(now - ago)
        admission.reserve()
    assert refused(admission).retry_after_s in (10, 11)  # (30 s + the call's own time) / 3


def test_retry_after_grows_while_nothing_is_admitted_and_is_capped():
    admission = Admission(max_waiting=1)
    now = time.monotonic()
    admission.reserve()
    admission.admitted(now - 0.5)  # a fast pace, but 0.5 s ago
    admission.reserve()
    assert refused(admission).retry_after_s == 1
    slow = Admission(max_waiting=1)
    slow.reserve()
    slow.admitted(now - 45.0)  # the last place freed 45 s ago
    slow.reserve()
    assert refused(slow).retry_after_s in (45, 46)
    stuck = Admission(max_waiting=1)
    stuck.reserve()
    stuck.admitted(now - 3600.0)
    stuck.reserve()
    assert refused(stuck).retry_after_s == RETRY_MAX_S
