"""Streamed chat completions timed from a client (the `openai` package): time to the first
content token, the answer, and how many prompt tokens the server's prefix cache served
(`usage.prompt_tokens_details.cached_tokens`)."""

from __future__ import annotations

import os
import random
import string
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchlib.windows import percentile

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class ChatTiming:
    """One streamed chat completion as its client saw it."""

    ttft_s: float
    text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def timed_chat(client: Any, model: str, messages: Messages, max_tokens: int,
               cache: bool) -> ChatTiming:
    """Send `messages` greedily with `"cache_prompt": cache` and time the first content token
    (RuntimeError if none came)."""
    start, first, text = time.perf_counter(), None, ""
    prompt_tokens = cached = completion_tokens = -1
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"cache_prompt": cache})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
            completion_tokens = chunk.usage.completion_tokens
            details = chunk.usage.prompt_tokens_details
            cached = (details.cached_tokens or 0) if details is not None else 0
    if first is None:
        raise RuntimeError("the stream ended without a content token")
    return ChatTiming(first - start, text, prompt_tokens, cached, completion_tokens)


def make_text(num_chars: int, seed: object) -> str:
    """Printable text of `num_chars` characters (one token each on the built-in model)."""
    rng = random.Random(str(seed))
    alphabet = string.ascii_letters + string.digits + " "
    return "".join(rng.choice(alphabet) for _ in range(num_chars))


def summary(samples_s: Sequence[float]) -> str:
    """p50 / p95 / p99 / worst of `samples_s`, in seconds."""
    q = {p: percentile(samples_s, p) for p in (50, 95, 99)}
    return (f"p50 {q[50]:.3f} s  p95 {q[95]:.3f} s  p99 {q[99]:.3f} s  "
            f"worst {max(samples_s):.3f} s  (n={len(samples_s)})")


def load_average() -> str:
    """The 1, 5 and 15-minute load averages (the machine is shared: print them beside
    results)."""
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())
