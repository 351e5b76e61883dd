"""One HTTP request's bridge to the engine: submit, receive token events on the event loop,
abort.

An HTTP request is one engine request per prompt (a completions batch has several), each with
`n` choices; events come renumbered with the choice's index in the response (prompt i, choice
j: i * n + j). The engine calls the sinks from its own thread; a sink only hands the event to
the loop, so the engine never waits on a client. One relay per event loop carries them: the
events a tick publishes for all its streams cost one wakeup of the loop (one
`call_soon_threadsafe`), not one each, and a handler waits on a plain future, not a task per
event (the loop's per-token work shares the machine's cores with the engine). `close()` aborts
every choice not finished yet: the route calls it in a `finally`, which is how a client that
disconnects (Sanic cancels the handler task) frees its slots.
"""

from __future__ import annotations

import asyncio
import math
import threading
import weakref
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from runtime.api import AbortCause, EngineDead, EngineFull, GenerationRequest, Sink, TokenEvent
from server.errors import ApiError, invalid

# How often a waiting request checks that the engine thread is still alive.
ENGINE_POLL_S = 1.0


class _Relay:
    """Events from the engine thread to one event loop's streams: the first event since the last
    drain schedules one drain, and the events that follow ride on it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[EventStream, TokenEvent]] = []

    def put(self, stream: EventStream, event: TokenEvent) -> None:
        with self._lock:
            self._pending.append((stream, event))
            if len(self._pending) > 1:  # a drain is scheduled already
                return
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop has closed (server shutdown); nobody is listening
            pass

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for stream, event in pending:
            stream._deliver(event)


_relays: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Relay] = \
    weakref.WeakKeyDictionary()


def _relay(loop: asyncio.AbstractEventLoop) -> _Relay:
    relay = _relays.get(loop)
    if relay is None:
        relay = _relays[loop] = _Relay(loop)
    return relay


class EventStream:
    """Token events of the submitted requests, in order within each choice, until every choice
    has sent its finishing event."""

    def __init__(self, engine: Any, *requests: GenerationRequest) -> None:
        self.engine = engine
        self.requests = requests
        self.num_choices = sum(r.n for r in requests)
        self.finished = False
        self._open = {r.request_id: r.n for r in requests}  # choices not finished, by request
        self._loop = asyncio.get_running_loop()
        self._relay = _relay(self._loop)
        self._events: deque[TokenEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def _sink(self, event: TokenEvent) -> None:
        # On the engine thread.
        self._relay.put(self, event)

    def _deliver(self, event: TokenEvent) -> None:
        # On the loop.
        self._events.append(event)
        if self._waiter is not None:
            _wake(self._waiter)

    def _sink_from(self, first: int) -> Sink:
        # A request's events, its choice j renumbered as choice `first + j` of the response
        # (the first request's need no copy: its numbers are the response's).
        if first == 0:
            return self._sink
        return lambda event: self._sink(replace(event, index=first + event.index))

    def submit(self, prompt_param: str) -> None:
        """Hand the requests to the engine (none of a batch the queue could never hold); a
        refusal aborts the ones handed over already and becomes the matching HTTP error."""
        check_fits_queue(len(self.requests), self.engine.admission.max_waiting, prompt_param)
        first = 0
        try:
            for earlier, request in enumerate(self.requests):
                # A batch's prompt is named by its place, as validation names it.
                param = prompt_param if len(self.requests) == 1 else \
                    f"{prompt_param}[{earlier}]"
                self._submit_one(request, self._sink_from(first), param, earlier)
                first += request.n
        except BaseException:
            self.close("error")
            raise

    def _submit_one(self, request: GenerationRequest, sink: Sink, prompt_param: str,
                    earlier: int) -> None:
        # `earlier`: this batch's prompts handed over before this one (each took a queue place).
        try:
            self.engine.submit(request, sink)
        except EngineFull as exc:
            retry_s = max(1, math.ceil(exc.retry_after_s))
            own = "" if not earlier else \
                f"; this batch's {earlier} earlier prompt{'s' if earlier > 1 else ''} took " \
                f"{'places' if earlier > 1 else 'a place'} in it too, and " \
                f"{'are' if earlier > 1 else 'is'} aborted"
            raise ApiError(429, f"The server is at capacity: {exc}{own}. Retry after "
                           f"{retry_s} s", code="server_busy",
                           headers={"Retry-After": str(retry_s)}) from None
        except EngineDead as exc:
            raise engine_unavailable(str(exc)) from None
        except ValueError as exc:
            where = f"{prompt_param}: " if prompt_param.endswith("]") else ""
            raise invalid(f"{where}{exc}", prompt_param) from None

    async def events(self) -> AsyncIterator[TokenEvent]:
        """Yield events until every choice has finished; a dead engine ends the stream with an
        error."""
        while not self.finished:
            event = await self._next_event()
            if event.finish_reason is not None and event.request_id in self._open:
                self._open[event.request_id] -= 1
                if not self._open[event.request_id]:
                    del self._open[event.request_id]
            self.finished = not self._open
            yield event

    async def _next_event(self) -> TokenEvent:
        # A plain future, not asyncio.wait_for: before Python 3.12 wait_for swallows a
        # cancellation (the client went away) that arrives as an event does, and the handler
        # would then run the whole generation for nobody. Awaiting a future lets it through, and
        # an event that came with it stays in the deque.
        while not self._events:
            waiter = self._waiter = self._loop.create_future()
            timer = self._loop.call_later(ENGINE_POLL_S, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
            if not self._events and not self.engine.alive:
                self._open.clear()
                return TokenEvent(self.requests[0].request_id, None, "", finish_reason="error",
                                  error="the engine thread has stopped")
        return self._events.popleft()

    def close(self, cause: AbortCause) -> None:
        """Abort every choice not finished yet: its client went away, or the handler failed
        (`cause` says which, for /metrics and the log)."""
        self.finished = True
        for request_id in list(self._open):
            del self._open[request_id]
            try:
                self.engine.abort(request_id, cause)
            except EngineDead:  # nothing left to free
                pass


def check_fits_queue(num_requests: int, max_waiting: int, prompt_param: str) -> None:
    """A 400 for a batch of more prompts than the waiting queue holds: each prompt takes a place
    in it (its `n` choices take none), so even an idle server could never queue it whole, and a
    429 would ask the client to retry what can never succeed. One that fits an empty queue but
    not the current one gets the engine's 429."""
    if max_waiting < num_requests:
        raise invalid(f"This request sends {num_requests} prompts and each takes a place in the "
                      f"queue of requests waiting to run, which holds {max_waiting} "
                      f"(--max-waiting {max_waiting}): it could never be queued. Send at most "
                      f"{max_waiting} prompt{'s' if max_waiting > 1 else ''} per request (n does "
                      "not count: a prompt's choices share its place)", prompt_param)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def engine_unavailable(reason: str) -> ApiError:
    return ApiError(503, f"The engine is not running ({reason}); the server cannot generate",
                    code="engine_unavailable")
