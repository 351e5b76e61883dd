"""OpenAI response shapes for completions and chat, whole and as server-sent-event chunks (chat
with the tool calls read from the output: `tool_calls` in the message or in deltas)."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from server.tool_calls import ToolCall


@dataclass(frozen=True)
class ResponseHeader:
    """What every body and chunk of one response repeats."""

    request_id: str
    kind: str  # "completion" or "chat"
    model: str
    created: int
    # stream_options.include_usage: every chunk but the last (the usage chunk) has "usage": null
    include_usage: bool = False
    fingerprint: str | None = None  # OpenAI's system_fingerprint (`system_fingerprint`)


def make_header(kind: str, model: str, include_usage: bool = False,
                fingerprint: str | None = None) -> ResponseHeader:
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    return ResponseHeader(f"{prefix}-{uuid.uuid4().hex}", kind, model, int(time.time()),
                          include_usage, fingerprint)


def system_fingerprint(*parts: str) -> str:
    """OpenAI's `system_fingerprint`: "fp_" and a digest of what, besides the request, decides
    the output (the caller names it: the server's version, the model, MLX and its BLAS), so a
    client sees when the same request may give other tokens."""
    return "fp_" + hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Choice:
    """One finished choice of a whole response: its index, text (a chat's content: None when
    tool calls left none), finish reason, log-probabilities (server/logprobs_format.py; None when
    not asked for) and the tool calls read from it."""

    index: int
    text: str | None
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None
    calls: tuple[ToolCall, ...] = ()


def finish_reason(reason: str | None, num_calls: int) -> str | None:
    """OpenAI's reason: "tool_calls" when the output ended with calls read from it."""
    return "tool_calls" if num_calls and reason == "stop" else reason


def tool_call(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """A call in a message, or (with `index`, its place among the choice's calls) in a delta."""
    out = {"id": call.id, "type": "function",
           "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage: every prompt counted once, the completion tokens of every choice, and
    (as OpenAI reports prompt caching) the prompt tokens whose KV was reused."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _envelope(header: ResponseHeader, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": header.request_id, "object": obj, "created": header.created,
            "model": header.model, "system_fingerprint": header.fingerprint, "choices": choices}


def full_body(header: ResponseHeader, choices: list[Choice],
              counts: dict[str, int]) -> dict[str, Any]:
    """The non-streaming response for a finished request, its choices in index order."""
    out = []
    for c in sorted(choices, key=lambda c: c.index):
        choice: dict[str, Any] = {"index": c.index, "logprobs": c.logprobs,
                                  "finish_reason": finish_reason(c.finish_reason, len(c.calls))}
        if header.kind == "completion":
            out.append({**choice, "text": c.text})
            continue
        message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
        if c.calls:
            message["tool_calls"] = [tool_call(call) for call in c.calls]
        out.append({**choice, "message": message})
    obj = "text_completion" if header.kind == "completion" else "chat.completion"
    return {**_envelope(header, obj, out), "usage": counts}


def _chunk(header: ResponseHeader, choice: dict[str, Any]) -> dict[str, Any]:
    # OpenAI: with include_usage, every chunk before the usage chunk carries "usage": null.
    obj = "text_completion" if header.kind == "completion" else "chat.completion.chunk"
    out = _envelope(header, obj, [choice])
    return {**out, "usage": None} if header.include_usage else out


def chunk(header: ResponseHeader, text: str | None, finish_reason: str | None,
          index: int = 0, logprobs: dict[str, Any] | None = None,
          calls_only: bool = False) -> dict[str, Any]:
    """One streamed chunk of choice `index`, with the log-probabilities of its tokens; for
    chat, `text=None` opens the assistant turn (the role delta), whose content is "" or, for a
    turn that can only be tool calls (`calls_only`: a forced tool_choice), null as OpenAI
    sends it and as the whole response has it."""
    choice: dict[str, Any] = {"index": index, "logprobs": logprobs,
                              "finish_reason": finish_reason}
    if header.kind == "completion":
        return _chunk(header, {**choice, "text": text or ""})
    if text is None and finish_reason is None:
        delta: dict[str, str | None] = {"role": "assistant",
                                        "content": None if calls_only else ""}
    else:
        delta = {"content": text} if text else {}
    return _chunk(header, {**choice, "delta": delta})


def call_chunk(header: ResponseHeader, call: ToolCall, call_index: int,
               index: int = 0) -> dict[str, Any]:
    """A streamed chat chunk of choice `index` carrying one whole tool call (its arguments in
    one piece), the choice's `call_index`-th."""
    choice = {"index": index, "logprobs": None, "finish_reason": None,
              "delta": {"tool_calls": [tool_call(call, call_index)]}}
    return _chunk(header, choice)


def usage_chunk(header: ResponseHeader, counts: dict[str, int]) -> dict[str, Any]:
    """The extra last chunk that `stream_options.include_usage` asks for: no choices, usage."""
    obj = "text_completion" if header.kind == "completion" else "chat.completion.chunk"
    return {**_envelope(header, obj, []), "usage": counts}


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"
