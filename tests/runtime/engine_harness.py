"""Drive a real Engine from a test: submit requests, collect their events, wait for the end."""

from __future__ import annotations

import threading
import time
from collections import defaultdict

from runtime.api import GenerationRequest, TokenEvent
from runtime.engine import Engine
from runtime.sampling import SamplingParams


class Collector:
    """Records every event with the time it arrived; `wait` blocks until requests finish."""

    def __init__(self) -> None:
        self.events: dict[str, list[tuple[float, TokenEvent]]] = defaultdict(list)
        self._done = threading.Condition()

    def sink(self, event: TokenEvent) -> None:
        with self._done:
            self.events[event.request_id].append((time.monotonic(), event))
            self._done.notify_all()

    def finished(self, request_id: str) -> bool:
        events = self.events.get(request_id)
        return bool(events) and events[-1][1].finish_reason is not None

    def wait(self, *request_ids: str, timeout: float = 60.0) -> None:
        with self._done:
            ok = self._done.wait_for(lambda: all(self.finished(r) for r in request_ids), timeout)
        assert ok, f"requests {request_ids} did not finish within {timeout} s"

    def tokens(self, request_id: str) -> list[int]:
        return [e.token_id for _, e in self.events[request_id] if e.token_id is not None]

    def text(self, request_id: str) -> str:
        return "".join(e.text for _, e in self.events[request_id])

    def last(self, request_id: str) -> TokenEvent:
        return self.events[request_id][-1][1]

    def first_token_time(self, request_id: str) -> float:
        return next(t for t, e in self.events[request_id] if e.token_id is not None)


def submit(engine: Engine, collector: Collector, request_id: str, prompt: list[int],
           **sampling: object) -> None:
    engine.submit(GenerationRequest(request_id, tuple(prompt), SamplingParams(**sampling)),
                  collector.sink)


def wait_until(predicate, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)
