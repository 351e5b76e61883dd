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
    # disconnected client's whole-body request ran to its end.
    engine = Engine(EngineConfig(), bundle)  # not started: only abort() is called on it

    async def scenario() -> list[TokenEvent]:
        stream = EventStream(engine, GenerationRequest("r1", (1, 2)))
        seen: list[TokenEvent] = []

        async def consume() -> None:
            async for event in stream.events():
                seen.append(event)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0)  # the consumer now waits on the queue
        stream._sink(TokenEvent("r1", 65, "A"))  # wakes it in the next iteration ...
        await asyncio.sleep(0)
        task.cancel()  # ... together with the cancellation
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), 5)
        return seen

    assert len(asyncio.run(scenario())) <= 1
