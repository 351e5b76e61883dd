"""The cluster's one HTTP endpoint: a Ray Serve deployment behind Ray's HTTP proxy that hands
each request, as it came, to a fairtick replica chosen by the router, and streams back that
replica's answer.

A replica that dies while it answers a stream ends the stream with an OpenAI-style error event
and `[DONE]`, as fairtick ends a stream that failed after its status was sent; one that dies
before it answered gets a 503 JSON error. `/metrics` is every replica's, labelled by replica
(cluster.metrics_merge). A request may name its replica in the `fairtick-replica` header
(e.g. for /debug/state of one replica); every answer names the replica in the same header.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from ray.exceptions import RayError
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from cluster.metrics_merge import merge_metrics
from cluster.pins import PIN_KWARG, PROMPT_BYTES_KWARG, live_replica_ids
from cluster.replica import REPLICA_HEADER, ReplyHead, end_to_end
from server.errors import ApiError
from server.openai_format import sse

log = logging.getLogger("fairtick.cluster")
# How long a request pinned to a replica waits for it (a pin to a replica that just died is
# retried by Ray until a replica of that id appears, which never happens).
PIN_TIMEOUT_S = 10.0
REPLICA_FAILURES = (RayError, RayServeException)


def replica_lost(exc: BaseException) -> ApiError:
    """The error a client sees when its replica stopped before it finished answering."""
    return ApiError(503, f"The replica serving this request stopped ({type(exc).__name__}); "
                    "retry: the other replicas serve, and Ray replaces the stopped one",
                    code="replica_unavailable")


class Ingress:
    """A Ray Serve deployment class: forwards each HTTP request to a fairtick replica."""

    def __init__(self, replicas: DeploymentHandle, deployment: str) -> None:
        self.replicas = replicas.options(stream=True)
        self.deployment = deployment

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        headers = end_to_end(request.headers.items())
        if request.method == "GET" and request.url.path == "/metrics":
            return await self._metrics(request.url.query, headers)
        return await self._forward(request.method, request.url.path, request.url.query,
                                   headers, body, request.headers.get(REPLICA_HEADER))

    async def _forward(self, method: str, path: str, query: str, headers: list[tuple[str, str]],
                       body: bytes, pin: str | None) -> Response:
        routing: dict[str, Any] = {PROMPT_BYTES_KWARG: len(body)}
        if pin:
            live = live_replica_ids(self.deployment)
            if live and pin not in live:
                return _error(ApiError(404, f"no live replica {pin!r} (header {REPLICA_HEADER}); "
                                       f"live replicas: {', '.join(live)}",
                                       param=REPLICA_HEADER, code="replica_not_found"))
            routing[PIN_KWARG] = pin
        stream = self.replicas.forward.remote(method, path, query, headers, body, **routing)
        try:
            head = await asyncio.wait_for(stream.__anext__(), PIN_TIMEOUT_S if pin else None)
            assert isinstance(head, ReplyHead)
            if _is_sse(head):
                return StreamingResponse(_relay(stream), status_code=head.status,
                                         headers=dict(head.headers))
            chunks = [bytes(chunk) async for chunk in stream]
        except (*REPLICA_FAILURES, asyncio.TimeoutError, StopAsyncIteration) as exc:
            stream.cancel()
            log.warning("%s %s: the replica failed before it answered: %r", method, path, exc)
            return _error(replica_lost(exc))
        return Response(b"".join(chunks), status_code=head.status, headers=dict(head.headers))

    async def _metrics(self, query: str, headers: list[tuple[str, str]]) -> Response:
        # Each live replica's /metrics, pinned to it; any answer but 200 (e.g. 401) is returned.
        texts: dict[str, str] = {}
        for replica in live_replica_ids(self.deployment) or [""]:
            answer = await self._forward("GET", "/metrics", query, headers, b"", replica or None)
            if answer.status_code != 200:
                if replica and answer.status_code in (404, 503):
                    continue  # it died since it was listed
                return answer
            name = answer.headers.get(REPLICA_HEADER, replica)
            texts[name] = bytes(answer.body).decode()
        return Response(merge_metrics(texts), media_type=CONTENT_TYPE_LATEST)


def _is_sse(head: ReplyHead) -> bool:
    return (head.header("content-type") or "").split(";")[0].strip() == "text/event-stream"


async def _relay(stream: DeploymentResponseGenerator) -> AsyncIterator[bytes]:
    try:
        async for chunk in stream:
            yield bytes(chunk)
    except REPLICA_FAILURES as exc:
        log.warning("a replica stopped during a stream: %r", exc)
        yield (sse(replica_lost(exc).to_body()) + sse("[DONE]")).encode()
    finally:
        stream.cancel()  # a no-op once it has ended; else the client went away


def _error(error: ApiError) -> JSONResponse:
    return JSONResponse(error.to_body(), status_code=error.status, headers=error.headers)
