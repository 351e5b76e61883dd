"""Streamed completions: a reference made alone first, streams that may be cut after k tokens
or a delay (retried after each 429), and what makes an uncut stream exact.

The built-in model emits one printable character per token and never EOS, so a stream's text
length is its token count."""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass, field

from benchlib.client import connect

from reliabilitylib.target import Target, failure_kind, retry_after_s

MAX_RETRIES = 30  # 429 retries per stream in load and storm (each waits Retry-After)


@dataclass
class Stream:
    """What one streamed completion received."""

    status: int | None = None
    pieces: list[str] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    usage: dict[str, int] | None = None
    ids: set[str] = field(default_factory=set)
    done: bool = False
    error: str | None = None
    failure: str | None = None
    retries: int = 0
    retry_after_s: float | None = None
    cut: bool = False

    @property
    def text(self) -> str:
        return "".join(self.pieces)


@dataclass(frozen=True)
class Reference:
    """A greedy completion made alone: what every later run of the prompt must equal."""

    prompt: str
    text: str
    prompt_tokens: int


def reference(t: Target, prompt: str, max_tokens: int) -> Reference:
    """The non-streamed completion of `prompt` (waiting out 429s); RuntimeError if it fails."""
    for _ in range(MAX_RETRIES):
        reply = t.exchange("POST", "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens})
        if reply.status != 429:
            break
        time.sleep(retry_after_s(reply.headers) or 1.0)
    if reply.status != 200:
        raise RuntimeError(f"reference request failed: HTTP {reply.status} {reply.body[:300]!r}")
    body = reply.json()
    return Reference(prompt, body["choices"][0]["text"], body["usage"]["prompt_tokens"])


def stream_once(t: Target, prompt: str, max_tokens: int, cut_after: float | None) -> Stream:
    """One streamed completion; `cut_after` closes the connection after that many tokens, or
    (when negative) -cut_after seconds after sending the request, reading nothing."""
    out = Stream()
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    conn = connect(t.url, t.timeout_s)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        if cut_after is not None and cut_after < 0:
            time.sleep(-cut_after)
            out.cut = True
            return out
        response = conn.getresponse()
        out.status = response.status
        if response.status != 200:
            out.error = response.read().decode(errors="replace")[:300]
            out.retry_after_s = retry_after_s({k.lower(): v for k, v in response.getheaders()})
            return out
        while not out.done:
            line = response.readline()
            if not line:
                break  # the stream ended without [DONE]
            if cut_after is not None and len(out.pieces) >= cut_after:
                out.cut = True
                return out
            read_event(line, out)
    except (OSError, http.client.HTTPException) as exc:
        out.failure = failure_kind(exc)
    finally:
        conn.close()
    return out


def read_event(line: bytes, out: Stream) -> None:
    """Add one SSE line's event to `out`."""
    if not line.startswith(b"data: "):
        return
    payload = line[len(b"data: "):].strip()
    if payload == b"[DONE]":
        out.done = True
        return
    event = json.loads(payload)
    if "error" in event:
        out.error = event["error"].get("message")
        return
    out.ids.add(event["id"])
    if event.get("usage"):
        out.usage = event["usage"]
    for choice in event["choices"]:
        if choice.get("text"):
            out.pieces.append(choice["text"])
        if choice.get("finish_reason"):
            out.finish.append(choice["finish_reason"])


def stream(t: Target, prompt: str, max_tokens: int, cut_after: float | None = None) -> Stream:
    """A streamed completion, retried after each 429 (up to MAX_RETRIES, honouring
    Retry-After)."""
    for attempt in range(MAX_RETRIES + 1):
        out = stream_once(t, prompt, max_tokens, cut_after)
        out.retries = attempt
        if out.status != 429:
            return out
        time.sleep(out.retry_after_s or 1.0)
    return out


def problems(out: Stream, ref: Reference, max_tokens: int) -> list[str]:
    """Why a stream that was not cut is wrong (empty when it is exact)."""
    if out.failure:
        return [out.failure]
    if out.status != 200:
        return [f"HTTP {out.status}"]
    found = []
    if out.error:
        found.append("in-band error")
    if not out.done:
        found.append("no [DONE]")
    if out.text != ref.text:
        found.append("text differs")
    if out.finish != ["length"]:
        found.append("finish reason")
    expected_usage = {"prompt_tokens": ref.prompt_tokens, "completion_tokens": max_tokens,
                      "total_tokens": ref.prompt_tokens + max_tokens}
    # Prompt tokens the prefix cache served: any of them but the last, which always runs.
    usage = dict(out.usage or {})
    cached = usage.pop("prompt_tokens_details", {}).get("cached_tokens")
    if usage != expected_usage or not (isinstance(cached, int) and
                                       0 <= cached < ref.prompt_tokens):
        found.append("usage")
    if len(out.ids) != 1:
        found.append("ids")
    return found
