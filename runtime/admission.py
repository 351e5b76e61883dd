"""Admission control at submission: a bounded queue of requests not yet admitted.

Answered on the caller's thread, so an overloaded server refuses at once (429 with
Retry-After) instead of queueing without end. KV memory is not reserved here: the scheduler
accounts it as it is used, and queues or preempts when it runs out (statemachine.world).
"""

from __future__ import annotations

import threading

from runtime.api import EngineFull


class Admission:
    """Counts the requests that arrived and were never admitted yet."""

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self._lock = threading.Lock()
        self.num_queued = 0

    def reserve(self) -> None:
        """Take a place in the queue, or raise EngineFull."""
        with self._lock:
            if self.num_queued >= self.max_waiting:
                waiting = "1 request is" if self.num_queued == 1 else \
                    f"{self.num_queued} requests are"
                raise EngineFull(f"{waiting} already waiting (--max-waiting {self.max_waiting})")
            self.num_queued += 1

    def admitted(self) -> None:
        """A queued request was admitted for the first time."""
        with self._lock:
            self.num_queued -= 1

    def release(self, queued: bool) -> None:
        """A request ended; `queued` if it was never admitted."""
        if queued:
            with self._lock:
                self.num_queued -= 1
