"""Admission control at submission: a bounded queue of requests not yet admitted.

Answered on the caller's thread, so an overloaded server refuses at once (429 with
Retry-After) instead of queueing without end. KV memory is not reserved here: the scheduler
accounts it as it is used, and queues or preempts when it runs out (statemachine.world).

Retry-After is how often a place has freed lately: the time since the oldest of the last
admissions (up to 16) over how many there were since, whole seconds, 1 to 60 (1 before any).
A queue that admits nothing for a while says so: the interval grows with the wait.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

from runtime.api import EngineFull

_RECENT = 16  # admissions whose pace sets Retry-After
RETRY_MAX_S = 60


class Admission:
    """Counts the requests that arrived and were never admitted yet."""

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self._lock = threading.Lock()
        self.num_queued = 0
        self._admitted_s: deque[float] = deque(maxlen=_RECENT)  # monotonic times of admissions

    def reserve(self) -> None:
        """Take a place in the queue, or raise EngineFull."""
        with self._lock:
            if self.num_queued >= self.max_waiting:
                waiting = "1 request is" if self.num_queued == 1 else \
                    f"{self.num_queued} requests are"
                raise EngineFull(f"{waiting} already waiting (--max-waiting {self.max_waiting})",
                                 self._retry_after_s(time.monotonic()))
            self.num_queued += 1

    def admitted(self, now_s: float) -> None:
        """A queued request was admitted for the first time, at `now_s` (time.monotonic)."""
        with self._lock:
            self.num_queued -= 1
            self._admitted_s.append(now_s)

    def _retry_after_s(self, now_s: float) -> int:
        # The mean interval between the recent admissions, the open one up to now included.
        if not self._admitted_s:
            return 1
        interval = (now_s - self._admitted_s[0]) / len(self._admitted_s)
        return min(RETRY_MAX_S, max(1, math.ceil(interval)))

    def release(self, queued: bool) -> None:
        """A request ended; `queued` if it was never admitted."""
        if queued:
            with self._lock:
                self.num_queued -= 1
