"""EventStream, the bridge between one handler and the engine: a cancelled handler (the client
went away) stops at once, even when an event arrives in the same loop iteration."""

from __future__ import annotations

import asyncio

import pytest

from runtime.api import GenerationRequest, TokenEvent
from runtime.engine import Engine, EngineConfig
from server.streams import EventStream


def test_a_cancellation_racing_an_event_is_not_swallowed(bundle):
    # asyncio.wait_for before Python 3.12 returned the event and dropped the cancellation, so a
    # disconnected client's whole-body request ran to its end (with it, this test times out).
    # Not started: the stream is cancelled long before it would ask whether the engine is alive.
    engine = Engine(EngineConfig(), bundle)

    async def scenario() -> None:
        stream = EventStream(engine, GenerationRequest("r1", (1, 2)))

        async def consume() -> None:
            async for _ in stream.events():
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0)  # the consumer now waits on the queue
        stream._sink(TokenEvent("r1", 65, "A"))  # wakes it in the next iteration ...
        await asyncio.sleep(0)
        task.cancel()  # ... together with the cancellation
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), 5)
        assert task.cancelled()

    asyncio.run(scenario())
