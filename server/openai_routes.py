"""OpenAI-compatible generation routes: /v1/completions, /v1/chat/completions (whole or SSE).

Each generation request: validate (server.validation) -> submit to the engine -> relay its token
events, as one JSON body or as `data: {...}` chunks ending with `data: [DONE]`. The `finally`
around the relay aborts the sequence when the client goes away before it finished. Unknown fields
in a body are ignored; the response names them in `fairtick-ignored-fields` (ADR 0010).
"""

from __future__ import annotations

import asyncio
import logging

from sanic import Blueprint, Request
from sanic.response import HTTPResponse, JSONResponse, json

from runtime.api import AbortCause, GenerationRequest, TokenEvent
from server import openai_format as fmt
from server.body_reading import ignored_header, log_ignored
from server.errors import ApiError
from server.streams import EventStream, engine_unavailable
from server.validation import Kind, ValidRequest, parse_body, validate_request

log = logging.getLogger("fairtick.server")


def make_openai_blueprint() -> Blueprint:
    """The /v1 surface; a new blueprint per app so tests can run several apps."""
    bp = Blueprint("openai", url_prefix="/v1")
    bp.add_route(completions, "/completions", methods=["POST"])
    bp.add_route(chat_completions, "/chat/completions", methods=["POST"])
    return bp


async def completions(request: Request) -> HTTPResponse | None:
    return await _generate(request, "completion")


async def chat_completions(request: Request) -> HTTPResponse | None:
    return await _generate(request, "chat")


async def _generate(request: Request, kind: Kind) -> HTTPResponse | None:
    ctx = request.app.ctx
    if ctx.draining:
        raise engine_unavailable("the server is shutting down")
    body = parse_body(request.body, request.headers.get("content-type"),
                      ctx.config.max_body_bytes)
    valid = validate_request(kind, body, ctx.limits, ctx.encoder)
    header = fmt.make_header(kind, ctx.limits.name)
    log_ignored(header.request_id, valid.ignored)
    stream = EventStream(ctx.engine, GenerationRequest(header.request_id, valid.prompt_tokens,
                                                       valid.sampling, valid.cache_prompt))
    stream.submit("prompt" if kind == "completion" else "messages")
    request.ctx.accepted = True  # its outcome is the engine's to count, not a refusal
    cause: AbortCause = "error"  # if the handler fails before the request finished
    try:
        if valid.stream:
            await _relay_sse(request, stream, header, valid)
            return None
        return await _collect(stream, header, ignored_header(list(valid.ignored)))
    except asyncio.CancelledError:
        log.info("client of %s went away; aborting it", header.request_id)
        cause = "client_disconnect"
        raise
    finally:
        stream.close(cause)


async def _collect(stream: EventStream, header: fmt.ResponseHeader,
                   headers: dict[str, str]) -> JSONResponse:
    parts: list[str] = []
    async for event in stream.events():
        parts.append(event.text)
    _raise_if_failed(stream, event)
    return json(fmt.full_body(header, "".join(parts), event), headers=headers)


def _raise_if_failed(stream: EventStream, last: TokenEvent) -> None:
    if last.finish_reason == "error":
        if not stream.engine.alive:
            raise engine_unavailable(last.error or "stopped")
        raise ApiError(500, f"Generation failed: {last.error}", code="generation_error")
    if last.finish_reason == "abort":
        raise engine_unavailable(last.error or "the request was aborted by the server")


async def _relay_sse(
    request: Request, stream: EventStream, header: fmt.ResponseHeader, valid: ValidRequest
) -> None:
    response = await request.respond(
        content_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Request-Id": header.request_id,
                 **ignored_header(list(valid.ignored))},
    )
    await response.send("", end_stream=False)  # the headers, now: the request is accepted
    if header.kind == "chat":
        await response.send(fmt.sse(fmt.chunk(header, None, None)))
    async for event in stream.events():
        if event.text:
            await response.send(fmt.sse(fmt.chunk(header, event.text, None)))
        if event.finish_reason is None:
            continue
        try:
            _raise_if_failed(stream, event)
        except ApiError as exc:  # the status is sent already: report the failure in-band
            await response.send(fmt.sse(exc.to_body()))
            break
        await response.send(fmt.sse(fmt.chunk(header, "", event.finish_reason)))
        if valid.include_usage:
            await response.send(fmt.sse(fmt.usage_chunk(header, event)))
    await response.send(fmt.sse("[DONE]"))
    await response.eof()
