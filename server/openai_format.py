"""OpenAI response shapes for completions and chat, whole and as server-sent-event chunks."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from runtime.api import TokenEvent


@dataclass(frozen=True)
class ResponseHeader:
    """What every body and chunk of one response repeats."""

    request_id: str
    kind: str  # "completion" or "chat"
    model: str
    created: int


def make_header(kind: str, model: str) -> ResponseHeader:
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    return ResponseHeader(f"{prefix}-{uuid.uuid4().hex}", kind, model, int(time.time()))


def usage(event: TokenEvent) -> dict[str, Any]:
    return {
        "prompt_tokens": event.num_prompt_tokens,
        "completion_tokens": event.num_generated_tokens,
        "total_tokens": event.num_prompt_tokens + event.num_generated_tokens,
        # As OpenAI reports prompt caching: prompt tokens whose KV was reused.
        "prompt_tokens_details": {"cached_tokens": event.num_cached_tokens},
    }


def _envelope(header: ResponseHeader, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": header.request_id, "object": obj, "created": header.created,
            "model": header.model, "choices": choices}


def full_body(header: ResponseHeader, text: str, last: TokenEvent) -> dict[str, Any]:
    """The non-streaming response for a finished request."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": last.finish_reason}
    if header.kind == "completion":
        body = _envelope(header, "text_completion", [{**choice, "text": text}])
    else:
        message = {"role": "assistant", "content": text}
        body = _envelope(header, "chat.completion", [{**choice, "message": message}])
    body["usage"] = usage(last)
    return body


def chunk(header: ResponseHeader, text: str | None, finish_reason: str | None) -> dict[str, Any]:
    """One streamed chunk; for chat, `text=None` opens the assistant turn (the role delta)."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
    if header.kind == "completion":
        return _envelope(header, "text_completion", [{**choice, "text": text or ""}])
    if text is None and finish_reason is None:
        delta: dict[str, str] = {"role": "assistant", "content": ""}
    else:
        delta = {"content": text} if text else {}
    return _envelope(header, "chat.completion.chunk", [{**choice, "delta": delta}])


def usage_chunk(header: ResponseHeader, last: TokenEvent) -> dict[str, Any]:
    """The extra last chunk that `stream_options.include_usage` asks for: no choices, usage."""
    obj = "text_completion" if header.kind == "completion" else "chat.completion.chunk"
    return {**_envelope(header, obj, []), "usage": usage(last)}


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"
