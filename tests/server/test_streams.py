"""EventStream, the bridge between one handler and the engine: a cancelled handler (the client
went away) stops at once, even when an event arrives in the same loop iteration; the events a
tick publishes for many streams reach each in order and wake the loop once."""

from __future__ import annotations

import asyncio
import threading

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


def test_a_ticks_events_for_many_streams_wake_the_loop_once_and_arrive_in_order(bundle):
    engine = Engine(EngineConfig(), bundle)  # not started: the test plays the engine thread

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        streams = [EventStream(engine, GenerationRequest(f"r{i}", (1, 2))) for i in range(3)]
        wakeups = []
        real = loop.call_soon_threadsafe

        def counted(callback, *args):  # noqa: ANN001, ANN202
            if getattr(callback, "__name__", "") == "_drain":  # the relay's, not asyncio's own
                wakeups.append(callback)
            return real(callback, *args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]

        def tick() -> None:  # three tokens for every stream, as an engine thread sends them
            for n in range(3):
                for i, stream in enumerate(streams):
                    last = "length" if n == 2 else None
                    stream._sink(TokenEvent(f"r{i}", 65 + n, chr(65 + n), finish_reason=last))

        # The loop is busy while the thread publishes: every event rides on the first wakeup.
        publisher = threading.Thread(target=tick)
        publisher.start()
        publisher.join()
        assert len(wakeups) == 1
        for i, stream in enumerate(streams):
            texts = [event.text async for event in stream.events()]
            assert texts == ["A", "B", "C"], f"stream {i}"
            assert stream.finished
        # A later event schedules a drain of its own.
        late = EventStream(engine, GenerationRequest("late", (1, 2)))
        await loop.run_in_executor(None, late._sink, TokenEvent("late", 68, "D", "stop"))
        assert [event.text async for event in late.events()] == ["D"]
        assert len(wakeups) == 2

    asyncio.run(scenario())
