"""Drive a real Engine from a test: submit requests, collect their events, wait for the end,
and hold the engine thread inside a real call while the test acts."""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from runtime.api import GenerationRequest, TokenEvent
from runtime.engine import Engine
from runtime.sampling import SamplingParams


class Collector:
    """Records every event with its place in the order the engine published them (the engine
    thread calls every sink in turn); `wait` blocks until requests finish."""

    def __init__(self) -> None:
        self.events: dict[str, list[tuple[int, TokenEvent]]] = defaultdict(list)
        self._order = itertools.count()
        self._done = threading.Condition()

    def sink(self, event: TokenEvent) -> None:
        with self._done:
            self.events[event.request_id].append((next(self._order), event))
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

    def last_order(self, request_id: str) -> int:
        """Where the request's last event came in the order of all events."""
        return self.events[request_id][-1][0]

    def first_token_order(self, request_id: str) -> int:
        """Where the request's first token came in the order of all events."""
        return next(n for n, e in self.events[request_id] if e.token_id is not None)


def submit(engine: Engine, collector: Collector, request_id: str, prompt: list[int],
           **sampling: object) -> None:
    engine.submit(GenerationRequest(request_id, tuple(prompt), SamplingParams(**sampling)),
                  collector.sink)


def wait_until(predicate: Callable[[], object], timeout: float = 30.0) -> None:
    """Until `predicate()` holds; fails the test after `timeout` seconds (a guard against a hang,
    never the thing tested)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


class Gate:
    """Holds the engine thread inside the real `obj.name(...)` (e.g. the executor's `prefill`)
    until the test opens the gate, so the test acts while that work is known to be running.
    Only the first call for which `when(*args)` holds is held; every call runs the real method.
    Install with `hold(monkeypatch, obj, name)`; always `open()` it (a `finally`)."""

    def __init__(self, real: Callable[..., Any], when: Callable[..., bool],
                 timeout_s: float) -> None:
        self.entered = threading.Event()
        self._open = threading.Event()
        self._real, self._when, self._timeout_s = real, when, timeout_s

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.entered.is_set() and self._when(*args):
            self.entered.set()
            if not self._open.wait(self._timeout_s):
                raise RuntimeError("the test never opened the gate")
        return self._real(*args, **kwargs)

    def wait_entered(self, timeout_s: float = 30.0) -> None:
        assert self.entered.wait(timeout_s), "the held call never started"

    def open(self) -> None:
        self._open.set()


def hold(monkeypatch: Any, obj: object, name: str,
         when: Callable[..., bool] = lambda *args: True, timeout_s: float = 60.0) -> Gate:
    """Put a Gate in front of `obj.name` for the rest of the test."""
    gate = Gate(getattr(obj, name), when, timeout_s)
    monkeypatch.setattr(obj, name, gate)
    return gate
