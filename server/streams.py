"""One request's bridge to the engine: submit, receive token events on the event loop, abort.

The engine calls the sink from its own thread; the sink only hands the event to the loop
(`call_soon_threadsafe`), so the engine never waits on a client. `close()` aborts the sequence
unless it already finished: the route calls it in a `finally`, which is how a client that
disconnects (Sanic cancels the handler task) frees its slot.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import Any

from runtime.api import AbortCause, EngineDead, EngineFull, GenerationRequest, TokenEvent
from server.errors import ApiError, invalid

# How often a waiting request checks that the engine thread is still alive.
ENGINE_POLL_S = 1.0


class EventStream:
    """Token events of one submitted request, in order, ending with the finishing event."""

    def __init__(self, engine: Any, request: GenerationRequest) -> None:
        self.engine = engine
        self.request = request
        self.finished = False
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

    def _sink(self, event: TokenEvent) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the loop has closed (server shutdown); nobody is listening
            pass

    def submit(self, prompt_param: str) -> None:
        """Hand the request to the engine; refusals become the matching HTTP error."""
        try:
            self.engine.submit(self.request, self._sink)
        except EngineFull as exc:
            retry_s = max(1, math.ceil(exc.retry_after_s))
            raise ApiError(429, f"The server is at capacity: {exc}. Retry after {retry_s} s",
                           code="server_busy", headers={"Retry-After": str(retry_s)}) from None
        except EngineDead as exc:
            raise engine_unavailable(str(exc)) from None
        except ValueError as exc:
            raise invalid(str(exc), prompt_param) from None

    async def events(self) -> AsyncIterator[TokenEvent]:
        """Yield events until the finishing one; a dead engine ends the stream with an error."""
        while not self.finished:
            event = await self._next_event()
            self.finished = event.finish_reason is not None
            yield event

    async def _next_event(self) -> TokenEvent:
        # Not asyncio.wait_for: before Python 3.12 it swallows a cancellation (the client went
        # away) that arrives as the queue yields an event, and the handler would then run the
        # whole generation for nobody. asyncio.wait lets the cancellation through.
        while self._queue.empty():
            getter = asyncio.ensure_future(self._queue.get())
            try:
                await asyncio.wait({getter}, timeout=ENGINE_POLL_S)
            finally:
                getter.cancel()
            if getter.done() and not getter.cancelled():
                return getter.result()
            if not self.engine.alive:
                return TokenEvent(self.request.request_id, None, "", finish_reason="error",
                                  error="the engine thread has stopped")
        return self._queue.get_nowait()

    def close(self, cause: AbortCause) -> None:
        """Abort the sequence if it has not finished: its client went away, or the handler
        failed (`cause` says which, for /metrics and the log)."""
        if not self.finished:
            self.finished = True
            try:
                self.engine.abort(self.request.request_id, cause)
            except EngineDead:  # nothing left to free
                pass


def engine_unavailable(reason: str) -> ApiError:
    return ApiError(503, f"The engine is not running ({reason}); the server cannot generate",
                    code="engine_unavailable")
