"""One fairtick replica: a whole `fairtick serve` (engine and Sanic app) inside a Ray Serve
replica, serving on 127.0.0.1 of its own machine; the ingress reaches it through `forward`.

Each request the ingress forwards (method, path, query, headers, body) is sent to the
replica's own Sanic app over the loopback and its answer streamed back as it comes: first a
`ReplyHead` (status and headers, with `fairtick-replica` added), then the body's chunks. So
every route, validation, error and SSE chunk is fairtick's own code, unchanged (ADR 0013).
The replica reports its engine's load to the router (`record_routing_stats`) and fails Ray's
health check once its engine thread has stopped, so that Ray replaces it.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
from ray import serve

from cluster.load import engine_load
from server.app import create_app
from server.config import ServerConfig
from server.logs import configure_logging

log = logging.getLogger("fairtick.cluster")
REPLICA_HEADER = "fairtick-replica"
# Headers of one hop (RFC 9110 7.6.1) and those the next hop computes again.
HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                         "te", "trailer", "transfer-encoding", "upgrade", "host",
                         "content-length"})


@dataclass(frozen=True)
class ReplyHead:
    """The status and headers of a replica's answer: the first item `forward` yields."""

    status: int
    headers: tuple[tuple[str, str], ...]

    def header(self, name: str) -> str | None:
        """The first value of header `name` (case-insensitive), or None."""
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)


def end_to_end(headers: Any) -> list[tuple[str, str]]:
    """`headers` (pairs) without the hop-by-hop ones."""
    return [(k, v) for k, v in headers if k.lower() not in HOP_HEADERS]


class FairtickReplica:
    """A Ray Serve deployment class: an engine and its Sanic app on a loopback port."""

    async def __init__(self, config: ServerConfig) -> None:
        configure_logging(config.log_level)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.app = create_app(replace(config, host="127.0.0.1"))
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        server = await self.app.create_server(sock=sock, backlog=config.listen_backlog,
                                              return_asyncio_server=True,
                                              access_log=config.access_log)
        assert server is not None  # return_asyncio_server=True
        self.server = server
        await server.startup()
        await server.before_start()  # loads the model and starts the engine
        await server.after_start()
        self.session = aiohttp.ClientSession(auto_decompress=False,
                                             timeout=aiohttp.ClientTimeout(total=None))
        log.info("replica %s serves on %s", self.replica_id, self.url)

    async def forward(self, method: str, path: str, query: str, headers: list[tuple[str, str]],
                      body: bytes, **routing: Any) -> AsyncIterator[ReplyHead | bytes]:
        """The answer of this replica's app to one request: a ReplyHead, then body chunks.
        `routing` holds the keywords the router read (pin, prompt size); unused here."""
        url = f"{self.url}{path}" + (f"?{query}" if query else "")
        async with self.session.request(method, url, headers=end_to_end(headers), data=body,
                                        allow_redirects=False) as response:
            yield ReplyHead(response.status, (*end_to_end(response.headers.items()),
                                              (REPLICA_HEADER, self.replica_id)))
            async for chunk in response.content.iter_any():
                yield chunk

    def record_routing_stats(self) -> dict[str, Any]:
        """Called by Ray Serve every `request_routing_stats_period_s`: the engine's load."""
        return engine_load(self.app.ctx.engine, time.time()).to_stats()

    def check_health(self) -> None:
        """Called by Ray Serve; raising marks the replica unhealthy and Ray replaces it."""
        engine = self.app.ctx.engine
        if engine is None or not engine.alive:
            raise RuntimeError(f"replica {self.replica_id}: the engine thread has stopped "
                               f"({getattr(engine, 'error', None) or 'not running'})")

    async def __del__(self) -> None:
        # Ray Serve's graceful shutdown: Sanic's own (in-flight requests get the grace period).
        await self.session.close()
        await self.server.before_stop()
        await self.server.close()
        await self.server.after_stop()
