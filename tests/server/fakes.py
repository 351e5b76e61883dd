"""A scripted stand-in for runtime.engine.Engine, and a way to serve an app from a thread.

The fake lets route tests force what the real engine does rarely (refuse, fail, die, hang) and
records what the server asked of it (submits, aborts). It honours the same contract: the sink is
called from another thread, once per token and once more with the finish reason.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from runtime.api import EngineDead, EngineFull, GenerationRequest, Sink, TokenEvent
from statemachine.trace import TraceEvent, TraceLog
from tests.server.http_helpers import free_port


class ByteTokenizer:
    has_chat_template = False

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


class FakeEngine:
    """`mode`: "ok" (emit max_tokens tokens "a"), "full", "dead", "error" (one token, then a
    failure), "hang" (one token, then nothing until aborted), "queued" (nothing at all)."""

    def __init__(self, context_length: int = 128) -> None:
        self.bundle = SimpleNamespace(
            model=SimpleNamespace(args=SimpleNamespace(vocab_size=258)),
            tokenizer=ByteTokenizer(), name="fake-model", context_length=context_length)
        self.policy = SimpleNamespace(name="fake_policy", doc="", parameters=())
        self.registry = CollectorRegistry()
        self.running = Gauge("fairtick_requests_running", "running", registry=self.registry)
        self.trace = TraceLog()
        self.mode = "ok"
        self.alive = False
        self.submitted: list[GenerationRequest] = []
        self.aborted: list[str] = []
        self.token_delay_s = 0.001

    def start(self) -> None:
        self.alive = True

    def stop(self, grace_s: float = 5.0) -> None:
        self.alive = False

    def snapshot(self) -> dict[str, Any]:
        return {"policy": self.policy.name, "params": {}, "sequences": []}

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        if self.mode == "full":
            raise EngineFull("waiting queue is full (2 of 2)", retry_after_s=2.5)
        if self.mode == "dead" or not self.alive:
            raise EngineDead("engine thread died")
        self.submitted.append(request)
        self.trace.record(TraceEvent(len(self.submitted), len(self.submitted), "waiting",
                                     "parked_prefill", "admit", "fake"))
        threading.Thread(target=self._emit, args=(request, sink, self.mode), daemon=True).start()

    def _emit(self, request: GenerationRequest, sink: Sink, mode: str) -> None:
        rid, n_prompt = request.request_id, len(request.prompt_tokens)
        count = {"error": 1, "hang": 1, "queued": 0}.get(mode, request.sampling.max_tokens)
        for i in range(count):
            time.sleep(self.token_delay_s)
            sink(TokenEvent(rid, 97, "a", num_prompt_tokens=n_prompt, num_generated_tokens=i + 1))
        if mode == "error":
            sink(TokenEvent(rid, None, "", "error", "sampling exploded", n_prompt, 1))
        elif mode == "ok":
            sink(TokenEvent(rid, None, "", "length", None, n_prompt, count))

    def wait_aborted(self, request_id: str, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if request_id in self.aborted:
                return True
            time.sleep(0.01)
        return False


class ThreadedServer:
    """Serve a Sanic app on 127.0.0.1 from a background thread with its own event loop."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ThreadedServer:
        self._thread.start()
        if not self._ready.wait(30) or self._error is not None:
            raise RuntimeError("the test server did not start") from self._error
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)  # type: ignore[union-attr]
        self._thread.join(30)

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        server = await self.app.create_server(host="127.0.0.1", port=self.port,
                                              return_asyncio_server=True, access_log=False)
        await server.startup()
        await server.before_start()
        await server.after_start()
        self._ready.set()
        await self._stop.wait()
        await server.before_stop()
        await server.close()
        await server.after_stop()
