"""Admission control: a bounded waiting queue and a bound on tokens held in KV caches.

Both are answered at submission, on the caller's thread, so an overloaded server refuses at
once (429 with Retry-After) instead of queueing without end or running out of memory.
"""

from __future__ import annotations

import threading

from runtime.api import EngineFull


class Admission:
    """Counts requests queued without a slot and the KV tokens every live request may need
    (prompt + max_tokens, reserved at submission, released when the request ends)."""

    def __init__(self, max_waiting: int, max_kv_tokens: int | None) -> None:
        self.max_waiting, self.max_kv_tokens = max_waiting, max_kv_tokens
        self._lock = threading.Lock()
        self.num_queued = 0
        self.kv_tokens = 0

    def reserve(self, tokens: int) -> None:
        """Take a place in the queue and `tokens` of the KV budget, or raise EngineFull."""
        if self.max_kv_tokens is not None and tokens > self.max_kv_tokens:
            raise ValueError(f"the prompt plus max_tokens needs {tokens} KV tokens, more than "
                             f"the server's whole budget (--max-kv-tokens {self.max_kv_tokens})")
        with self._lock:
            if self.num_queued >= self.max_waiting:
                raise EngineFull(f"{self.num_queued} requests are already waiting "
                                 f"(--max-waiting {self.max_waiting})")
            if self.max_kv_tokens is not None and \
                    self.kv_tokens + tokens > self.max_kv_tokens:
                raise EngineFull(f"{self.kv_tokens} of {self.max_kv_tokens} KV tokens are "
                                 f"committed to running requests (--max-kv-tokens)")
            self.num_queued += 1
            self.kv_tokens += tokens

    def admitted(self) -> None:
        """A queued request got a slot."""
        with self._lock:
            self.num_queued -= 1

    def release(self, tokens: int, queued: bool) -> None:
        """A request ended; `queued` if it never got a slot."""
        with self._lock:
            self.kv_tokens -= tokens
            if queued:
                self.num_queued -= 1
