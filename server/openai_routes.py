"""OpenAI-compatible generation routes: /v1/completions, /v1/chat/completions (whole or SSE).

Each generation request: validate (server.validation) -> submit to the engine (one engine
request per prompt, each with `n` choices) -> relay its token events, as one JSON body (choices
in index order) or as `data: {...}` chunks, each carrying its choice's `index`, every choice
ending with its own finish chunk, then `data: [DONE]`. Each choice carries its own
log-probabilities and echoed prompt when asked for (server/logprobs_format.py): whole, or with
the chunks of its tokens. The `finally` around the relay aborts every choice when the client
goes away before they finished. Unknown fields in a body are ignored; the response names them in
`fairtick-ignored-fields` (ADR 0010).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from sanic import Blueprint, Request
from sanic.response import HTTPResponse, JSONResponse, json

from runtime.api import AbortCause, GenerationRequest, TokenEvent
from server import openai_format as fmt
from server.body_reading import ignored_header, log_ignored
from server.errors import ApiError
from server.logprobs_format import ChoiceLogprobs, choice_logprobs
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
    logprobs = choice_logprobs(valid, ctx.encoder.tokenizer)  # each choice's formatter, if asked
    stream = EventStream(ctx.engine, *engine_requests(header.request_id, valid))
    stream.submit("prompt" if kind == "completion" else "messages")
    request.ctx.accepted = True  # its outcome is the engine's to count, not a refusal
    cause: AbortCause = "error"  # if the handler fails before the request finished
    try:
        if valid.stream:
            await _relay_sse(request, stream, header, valid, logprobs)
            return None
        return await _collect(stream, header, valid, logprobs)
    except asyncio.CancelledError:
        log.info("client of %s went away; aborting it", header.request_id)
        cause = "client_disconnect"
        raise
    finally:
        stream.close(cause)


def engine_requests(request_id: str, valid: ValidRequest) -> list[GenerationRequest]:
    """One engine request per prompt, each with the request's `n` choices."""
    many = len(valid.prompts) > 1
    return [GenerationRequest(f"{request_id}-{i}" if many else request_id, p.tokens, p.sampling,
                              n=valid.n, cache_prompt=valid.cache_prompt)
            for i, p in enumerate(valid.prompts)]


def _usage(valid: ValidRequest, last: Iterable[TokenEvent]) -> dict[str, Any]:
    # Each prompt once: its cached tokens are its first choice's (siblings share its prefill).
    events = list(last)
    return fmt.usage(sum(len(p.tokens) for p in valid.prompts),
                     sum(e.num_generated_tokens for e in events),
                     sum(e.num_cached_tokens for e in events if e.index % valid.n == 0))


async def _collect(stream: EventStream, header: fmt.ResponseHeader, valid: ValidRequest,
                   logprobs: dict[int, ChoiceLogprobs]) -> JSONResponse:
    parts: dict[int, list[str]] = {i: [] for i in range(stream.num_choices)}
    last: dict[int, TokenEvent] = {}
    async for event in stream.events():
        choice = logprobs.get(event.index)
        if choice is not None:
            parts[event.index].append(choice.start(event) or "")  # the echo, at the first event
            choice.take(event)
        parts[event.index].append(event.text)
        if event.finish_reason is not None:
            _raise_if_failed(stream, event)
            last[event.index] = event
    choices = [fmt.Choice(i, "".join(parts[i]), e.finish_reason,
                          logprobs[i].flush() if i in logprobs else None)
               for i, e in last.items()]
    return json(fmt.full_body(header, choices, _usage(valid, last.values())),
                headers=ignored_header(list(valid.ignored)))


def _raise_if_failed(stream: EventStream, last: TokenEvent) -> None:
    if last.finish_reason == "error":
        if not stream.engine.alive:
            raise engine_unavailable(last.error or "stopped")
        raise ApiError(500, f"Generation failed: {last.error}", code="generation_error")
    if last.finish_reason == "abort":
        raise engine_unavailable(last.error or "the request was aborted by the server")


async def _relay_sse(
    request: Request, stream: EventStream, header: fmt.ResponseHeader, valid: ValidRequest,
    logprobs: dict[int, ChoiceLogprobs],
) -> None:
    response = await request.respond(
        content_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Request-Id": header.request_id,
                 **ignored_header(list(valid.ignored))},
    )
    await response.send("", end_stream=False)  # the headers, now: the request is accepted
    if header.kind == "chat":
        for index in range(stream.num_choices):
            await response.send(fmt.sse(fmt.chunk(header, None, None, index)))
    last: dict[int, TokenEvent] = {}
    async for event in stream.events():
        choice = logprobs.get(event.index)
        if choice is not None:
            echo = choice.start(event)
            if echo is not None:  # the echoed prompt (and its log-probabilities) first
                await response.send(fmt.sse(fmt.chunk(header, echo, None, event.index,
                                                      choice.flush())))
            choice.take(event)
        if event.text:
            await response.send(fmt.sse(fmt.chunk(header, event.text, None, event.index,
                                                  _taken(choice))))
        if event.finish_reason is None:
            continue
        try:
            _raise_if_failed(stream, event)
        except ApiError as exc:  # the status is sent already: report the failure in-band
            await response.send(fmt.sse(exc.to_body()))
            break
        last[event.index] = event
        await response.send(fmt.sse(fmt.chunk(header, "", event.finish_reason, event.index,
                                              _taken(choice))))
    else:
        if valid.include_usage:
            await response.send(fmt.sse(fmt.usage_chunk(header, _usage(valid, last.values()))))
    await response.send(fmt.sse("[DONE]"))
    await response.eof()


def _taken(choice: ChoiceLogprobs | None) -> dict[str, Any] | None:
    # A chunk carries the log-probabilities of its choice's tokens taken since its last chunk.
    return choice.flush() if choice is not None else None
