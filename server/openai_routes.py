"""OpenAI-compatible generation routes: /v1/completions, /v1/chat/completions (whole or SSE).

Each generation request: validate (server.validation) -> submit to the engine (one engine
request per prompt, each with `n` choices) -> relay its token events, as one JSON body (choices
in index order) or as `data: {...}` chunks, each carrying its choice's `index`, every choice
ending with its own finish chunk, then `data: [DONE]`. Each choice carries its own
log-probabilities and echoed prompt when asked for (server/logprobs_format.py): whole, or with
the chunks of its tokens. The `finally` around the relay aborts every choice when the client
goes away before they finished. Unknown fields in a body are ignored; the response names them in
`fairtick-ignored-fields` (ADR 0010). A response format or a forced tool choice is compiled into
a grammar on a worker thread before submission; with tools offered, each choice's output is read
for calls (server/tool_calls.py), whole or as it streams.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from sanic import Blueprint, Request
from sanic.response import HTTPResponse, JSONResponse, json

from runtime.api import AbortCause, GenerationRequest, TokenEvent
from server import openai_format as fmt
from server.body_reading import ignored_header, log_ignored
from server.errors import ApiError
from server.logprobs_format import ChoiceLogprobs, choice_logprobs
from server.response_format import compile_off_loop, compile_response_format
from server.streams import EventStream, engine_unavailable
from server.tool_calls import (
    ToolCall,
    ToolCallStream,
    compile_tool_calls,
    parse_forced_calls,
    parse_tool_calls,
)
from server.validation import Kind, ValidRequest, parse_request_body, validate_request

if TYPE_CHECKING:
    from runtime.grammar import Grammar

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
    body = parse_request_body(request)
    valid = validate_request(kind, body, ctx.limits, ctx.encoder)
    grammar = await _compile_grammar(ctx.engine, valid)
    header = fmt.make_header(kind, ctx.limits.name, valid.include_usage, ctx.fingerprint)
    log_ignored(header.request_id, valid.ignored)
    try:
        return await _run(request, header, valid, grammar)
    except ApiError as exc:  # a refusal or failure names the id the log and the trace use
        exc.headers.setdefault("X-Request-Id", header.request_id)
        raise


async def _run(request: Request, header: fmt.ResponseHeader, valid: ValidRequest,
               grammar: Grammar | None) -> HTTPResponse | None:
    ctx = request.app.ctx
    logprobs = choice_logprobs(valid, ctx.encoder.tokenizer)  # each choice's formatter, if asked
    stream = EventStream(ctx.engine, *engine_requests(header.request_id, valid, grammar))
    stream.submit("prompt" if header.kind == "completion" else "messages")
    request.ctx.accepted = True  # its outcome is the engine's to count, not a refusal
    cause: AbortCause = "error"  # if the handler fails before the request finished
    try:
        if valid.stream and request.version == "1.0":
            held = _HeldEvents()
            await _relay_sse(held, stream, header, valid, logprobs)
            return HTTPResponse(held.body(), content_type="text/event-stream",
                                headers=_sse_headers(header, valid))
        if valid.stream:
            response = await request.respond(content_type="text/event-stream",
                                             headers=_sse_headers(header, valid))
            await response.send("", end_stream=False)  # the headers, now: the request is accepted
            await _relay_sse(response, stream, header, valid, logprobs)
            return None
        return await _collect(stream, header, valid, logprobs)
    except asyncio.CancelledError:
        log.info("client of %s went away; aborting it", header.request_id)
        cause = "client_disconnect"
        raise
    finally:
        stream.close(cause)


def engine_requests(request_id: str, valid: ValidRequest,
                    grammar: Grammar | None = None) -> list[GenerationRequest]:
    """One engine request per prompt, each with the request's `n` choices (and its grammar:
    each choice gets a matcher of its own), all parts of the response `request_id`."""
    many = len(valid.prompts) > 1
    return [GenerationRequest(f"{request_id}-{i}" if many else request_id, p.tokens, p.sampling,
                              n=valid.n, cache_prompt=valid.cache_prompt, grammar=grammar,
                              response_id=request_id, num_prompts=len(valid.prompts))
            for i, p in enumerate(valid.prompts)]


async def _compile_grammar(engine: Any, valid: ValidRequest) -> Grammar | None:
    # A response format, or a forced tool choice; "auto" tools only check their parameters.
    tools = valid.tools
    if tools is None:
        return await compile_response_format(engine, valid.response_format)
    return await compile_off_loop(lambda: compile_tool_calls(
        engine.grammars, list(tools.functions), tools.choice, tools.parallel))


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
    choices = [_choice(i, "".join(parts[i]), e, valid,
                       logprobs[i].flush() if i in logprobs else None)
               for i, e in last.items()]
    return json(fmt.full_body(header, choices, _usage(valid, last.values())),
                headers={"X-Request-Id": header.request_id,
                         **ignored_header(list(valid.ignored))})


def _choice(index: int, text: str, last: TokenEvent, valid: ValidRequest,
            logprobs: dict[str, Any] | None) -> fmt.Choice:
    if valid.tools is None:
        return fmt.Choice(index, text, last.finish_reason, logprobs)
    choice = valid.tools.choice
    if choice.forced:  # calls only, one cut short included
        calls = parse_forced_calls(text, valid.tools.names, choice)
        return fmt.Choice(index, None, last.finish_reason, logprobs, tuple(calls))
    content, calls = parse_tool_calls(text, valid.tools.names)
    return fmt.Choice(index, content, last.finish_reason, logprobs, tuple(calls))


def _raise_if_failed(stream: EventStream, last: TokenEvent) -> None:
    if last.finish_reason == "error":
        if not stream.engine.alive:
            raise engine_unavailable(last.error or "stopped")
        raise ApiError(500, f"Generation failed: {last.error}", code="generation_error")
    if last.finish_reason == "abort":
        raise engine_unavailable(last.error or "the request was aborted by the server")


def _sse_headers(header: fmt.ResponseHeader, valid: ValidRequest) -> dict[str, str]:
    return {"Cache-Control": "no-cache", "X-Request-Id": header.request_id,
            **ignored_header(list(valid.ignored))}


class _HeldEvents:
    """A stream's events held for a client that speaks HTTP/1.0, to go out as one body of known
    length: HTTP/1.0 has no chunked encoding, and Sanic frames a streamed body of unknown length
    with nothing else (an HTTP/1.0 client read its chunk sizes as text)."""

    def __init__(self) -> None:
        self._parts: list[str] = []

    async def send(self, data: str) -> None:
        self._parts.append(data)

    async def eof(self) -> None:
        pass

    def body(self) -> str:
        return "".join(self._parts)


class _EventSink(Protocol):
    """Where `_relay_sse` writes a stream's events: Sanic's streamed response, or held ones."""

    async def send(self, data: str) -> None: ...

    async def eof(self) -> None: ...


async def _relay_sse(
    response: _EventSink, stream: EventStream, header: fmt.ResponseHeader, valid: ValidRequest,
    logprobs: dict[int, ChoiceLogprobs],
) -> None:
    # A forced choice writes calls only.
    forced = valid.tools.choice if valid.tools is not None and valid.tools.choice.forced \
        else None
    if header.kind == "chat":
        for index in range(stream.num_choices):
            await response.send(fmt.sse(fmt.chunk(header, None, None, index,
                                                  calls_only=forced is not None)))
    last: dict[int, TokenEvent] = {}
    names = valid.tools.names if valid.tools is not None else None
    readers = {i: ToolCallStream(names, forced) for i in range(stream.num_choices)} \
        if names else {}
    num_calls = dict.fromkeys(range(stream.num_choices), 0)
    async for event in stream.events():
        choice = logprobs.get(event.index)
        if choice is not None:
            echo = choice.start(event)
            if echo is not None:  # the echoed prompt (and its log-probabilities) first
                await response.send(fmt.sse(fmt.chunk(header, echo, None, event.index,
                                                      choice.flush())))
            choice.take(event)
        reader = readers.get(event.index)
        parts: list[str | ToolCall] = [event.text] if reader is None else reader.feed(event.text)
        if reader is not None and event.finish_reason is not None:
            parts += reader.finish()
        # A content chunk carries the log-probabilities taken since its choice's last chunk (a
        # call's tokens: with the next content or finish chunk).
        for part in parts:
            if isinstance(part, ToolCall):
                await response.send(fmt.sse(fmt.call_chunk(header, part, num_calls[event.index],
                                                           event.index)))
                num_calls[event.index] += 1
            elif part:
                await response.send(fmt.sse(fmt.chunk(header, part, None, event.index,
                                                      _taken(choice))))
        if event.finish_reason is None:
            continue
        try:
            _raise_if_failed(stream, event)
        except ApiError as exc:  # the status is sent already: report the failure in-band
            await response.send(fmt.sse(exc.to_body()))
            break
        last[event.index] = event
        reason = fmt.finish_reason(event.finish_reason, num_calls[event.index])
        await response.send(fmt.sse(fmt.chunk(header, "", reason, event.index, _taken(choice))))
    else:
        if valid.include_usage:
            await response.send(fmt.sse(fmt.usage_chunk(header, _usage(valid, last.values()))))
    await response.send(fmt.sse("[DONE]"))
    await response.eof()


def _taken(choice: ChoiceLogprobs | None) -> dict[str, Any] | None:
    # A chunk carries the log-probabilities of its choice's tokens taken since its last chunk.
    return choice.flush() if choice is not None else None
