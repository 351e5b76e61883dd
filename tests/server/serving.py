"""The real app over the real engine, served in-process on 127.0.0.1 for route tests.

`serve(bundle, **engine_config)` builds an Engine over an already loaded model (the built-in one,
loaded once per module), wraps it in `create_app`, and serves it from a background thread with
its own event loop. Faults are injected into that real engine (`poison_prompts`), never faked.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from runtime.engine import Engine, EngineConfig
from server.app import create_app
from server.config import ServerConfig
from tests.server.http_helpers import free_port, get

# The one byte string that marks a prompt whose work `poison_prompts` makes fail.
POISON = b"POISON"


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


@dataclass
class Served:
    """A running app: its URL and the real engine behind it."""

    url: str
    engine: Engine

    def state(self) -> dict[str, Any]:
        return dict(get(self.url, "/debug/state").json())

    def trace(self, since_event: int = 0) -> list[dict[str, Any]]:
        lines = get(self.url, "/debug/trace").body.decode().splitlines()
        return [json.loads(line) for line in lines[since_event:]]

    def wait_for(self, what: Callable[[dict[str, Any]], bool], timeout_s: float = 10.0) -> None:
        """Until `what(/debug/state)` holds; fails the test after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not what(state := self.state()):
            assert time.monotonic() < deadline, f"condition never held: {state}"
            time.sleep(0.02)

    def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Until no sequence is live and admission holds nothing (no KV cached, none queued)."""
        self.wait_for(lambda s: not s["sequences"] and s["admission"]["queued"] == 0
                      and s["kv"]["cached_tokens"] == 0
                      and s["memory"]["cached_sequences"] == 0, timeout_s)


@contextmanager
def serve(bundle: Any, *, max_body_bytes: int = 4096, server: dict[str, Any] | None = None,
          **engine_config: Any) -> Iterator[Served]:
    """The real engine (EngineConfig fields as keywords) behind the real app, on 127.0.0.1;
    `server` holds further ServerConfig fields."""
    config = {"max_running": 1, "max_waiting": 1, "prefill_chunk_size": 32, **engine_config}
    engine = Engine(EngineConfig(**config), bundle)
    app = create_app(ServerConfig(max_body_bytes=max_body_bytes, stop_grace_s=0.0,
                                  **(server or {})), engine=engine)
    with ThreadedServer(app) as server:
        yield Served(server.url, engine)
    assert not engine.alive, "the app must stop its engine after the server stops"


def poison_prompts(engine: Engine, monkeypatch: Any, method: str) -> None:
    """Fault injection: a tick raises when it runs `method` work ("prefill" or "decode") of a
    sequence whose prompt contains POISON; every other piece of work runs as usual."""
    executor = engine.executor
    poisoned: set[int] = set()
    add, run = executor.add, executor.run

    def add_and_mark(seq_id: int, prompt_tokens: Any, sampling: Any, **options: Any) -> None:
        if POISON in bytes(t for t in prompt_tokens if t < 256):
            poisoned.add(seq_id)
        add(seq_id, prompt_tokens, sampling, **options)

    def failing(prefills: Any, decode: Any) -> Any:
        ids = [w.seq_id for w in prefills] if method == "prefill" else list(decode)
        if poisoned.intersection(ids):
            raise RuntimeError(f"injected fault in {method}")
        return run(prefills, decode)

    monkeypatch.setattr(executor, "add", add_and_mark)
    monkeypatch.setattr(executor, "run", failing)
