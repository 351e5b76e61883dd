"""Request-body libraries side by side: parse + validate cost per body and error quality, for
pydantic v2 (the body models fairtick serves with) and msgspec (the same bodies, mirrored).

    .venv/bin/python scripts/bench_body_models.py [--repeats 500] [--rounds 5]

Bodies: a small chat (one message), a large chat (100 messages, text and text-part content),
a completion (a 600-character prompt and the sampling fields). Per body and way of reading it,
each call is timed alone (`--repeats` calls a round, the ways interleaved round by round) and
p50/p95/p99/worst are printed in microseconds, with each way's p50 as a ratio of pydantic's
(the server's path: `parse_body` then `model_validate`). Then the error each library reports for
the same bad bodies, raw, beside the 400 message fairtick answers (server/body_reading.py).
ADR 0009 records a run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from server.body_models import ChatBody, CompletionBody  # noqa: E402
from server.body_reading import read_body  # noqa: E402
from server.errors import ApiError  # noqa: E402
from server.validation import parse_body  # noqa: E402

# --- the same bodies in msgspec (the fields and ranges of server/body_models.py) -------------

class _Base(Struct, kw_only=True, omit_defaults=True):
    pass


class TextPart(_Base, tag_field="type", tag="text"):
    text: str


class ImageUrl(_Base):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Base, tag_field="type", tag="image_url"):
    image_url: ImageUrl


class RefusalPart(_Base, tag_field="type", tag="refusal"):
    refusal: str


class Function(_Base):
    name: str
    arguments: str


class ToolCall(_Base):
    id: str
    type: Literal["function"]
    function: Function


class SystemMessage(_Base, tag_field="role", tag="system"):
    content: str | list[TextPart]
    name: str | None = None


class DeveloperMessage(_Base, tag_field="role", tag="developer"):
    content: str | list[TextPart]
    name: str | None = None


class UserMessage(_Base, tag_field="role", tag="user"):
    content: str | list[TextPart | ImagePart]
    name: str | None = None


class AssistantMessage(_Base, tag_field="role", tag="assistant"):
    content: str | list[TextPart | RefusalPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None


class ToolMessage(_Base, tag_field="role", tag="tool"):
    content: str | list[TextPart]
    tool_call_id: str | None = None


class StreamOptions(_Base):
    include_usage: bool | None = None


Number = Annotated[float, Meta(ge=0.0, le=2.0)]
Stop = str | Annotated[list[Annotated[str, Meta(min_length=1, max_length=256)]],
                       Meta(max_length=16)]
TokenKey = Annotated[str, Meta(pattern="^[0-9]{1,10}$")]


class _Generation(_Base):
    model: str | None = None
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Number | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=2**31 - 1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    stop: Stop | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Annotated[int, Meta(ge=1, le=128)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    logit_bias: dict[TokenKey, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None
    min_tokens: Annotated[int, Meta(ge=0)] | None = None
    user: str | None = None


class MsgspecChat(_Generation, kw_only=True):
    messages: Annotated[list[SystemMessage | DeveloperMessage | UserMessage | AssistantMessage
                             | ToolMessage], Meta(min_length=1, max_length=1024)]
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None


class MsgspecCompletion(_Generation, kw_only=True):
    # msgspec allows one array type in a union: list[str] | list[int] | list[list[int]] cannot be
    # declared, so the items are left loose here and would need a check of their own.
    prompt: str | list[str | int | list[int]]
    echo: bool | None = None
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None


# --- bodies -------------------------------------------------------------------------------------

SAMPLING = {"max_tokens": 64, "temperature": 0.7, "top_p": 0.9, "stop": ["\n\n"], "seed": 1}


def bodies() -> dict[str, tuple[bytes, type[Any], type[Any]]]:
    sentence = "The quick brown fox jumps over the lazy dog. " * 4
    large = [{"role": "system", "content": "Be brief."}]
    for i in range(99):
        if i % 2:
            large.append({"role": "assistant", "content": sentence})
        else:
            large.append({"role": "user", "content": [{"type": "text", "text": sentence}]})
    small_chat = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}
    return {
        "small chat": (json.dumps(small_chat).encode(), ChatBody, MsgspecChat),
        "large chat (100 messages)": (json.dumps({"messages": large, **SAMPLING}).encode(),
                                      ChatBody, MsgspecChat),
        "completion": (json.dumps({"prompt": "x" * 600, **SAMPLING}).encode(), CompletionBody,
                       MsgspecCompletion),
    }


def ways(raw: bytes, pyd: type[Any], msg: type[Any], request: Callable[[bytes], object]
         ) -> dict[str, Callable[[], object]]:
    """Each way of turning `raw` into a validated body (the first is the server's), and the
    server's whole validation with the prompt's tokenization, for scale."""
    return {
        "pydantic: parse_body + model_validate": lambda: pyd.model_validate(
            parse_body(raw, "application/json", 1 << 22)),
        "pydantic: model_validate_json": lambda: pyd.model_validate_json(raw),
        "msgspec: json.decode(type=)": lambda: msgspec.json.decode(raw, type=msg),
        "msgspec: parse_body + convert": lambda: msgspec.convert(
            parse_body(raw, "application/json", 1 << 22), msg),
        "json.loads alone": lambda: json.loads(raw),
        "fairtick: parse_body + validate_request (tokenized)": lambda: request(raw),
    }


def validator() -> Callable[[str, bytes], object]:
    """The server's validation of a body, with the built-in model's limits and tokenizer."""
    from runtime.model import load_model
    from server.app import model_limits
    from server.prompts import TokenizerEncoder
    from server.validation import validate_request

    bundle = load_model(None)
    limits, encoder = model_limits(bundle), TokenizerEncoder(bundle.tokenizer)
    return lambda kind, raw: validate_request(
        kind, parse_body(raw, "application/json", 1 << 22), limits, encoder)


def measure(repeats: int, rounds: int) -> None:
    print(f"# parse + validate, microseconds per body ({repeats} calls x {rounds} rounds)\n")
    print("| body | way | p50 | p95 | p99 | worst | p50 / server's |")
    print("|---|---|---|---|---|---|---|")
    validate = validator()
    for name, (raw, pyd, msg) in bodies().items():
        kind = "chat" if pyd is ChatBody else "completion"
        calls = ways(raw, pyd, msg, lambda raw, kind=kind: validate(kind, raw))
        times: dict[str, list[float]] = {way: [] for way in calls}
        for _ in range(rounds):  # interleaved, so a busy stretch of the machine hits every way
            for way, call in calls.items():
                for _ in range(repeats):
                    start = time.perf_counter_ns()
                    call()
                    times[way].append((time.perf_counter_ns() - start) / 1e3)
        base = statistics.median(times[next(iter(calls))])
        for way, samples in times.items():
            q = statistics.quantiles(samples, n=100)
            p50 = statistics.median(samples)
            print(f"| {name} ({len(raw)} B) | {way} | {p50:.1f} | {q[94]:.1f} | {q[98]:.1f} | "
                  f"{max(samples):.1f} | {p50 / base:.2f} |")


BAD_CHAT = [
    {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    {"messages": [{"role": "wizard", "content": "x"}]},
    {"messages": [{"role": {"a": 1}, "content": "x"}]},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user"}]},
    {"messages": [{"role": "assistant", "tool_calls": {"id": "c"}}]},
    {"messages": [{"role": "user", "content": "x"}], "temperature": 2.5},
    {"messages": [{"role": "user", "content": "x"}], "stop": ["a", 1]},
    {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"x": 1}},
    {"messages": [{"role": "user", "content": "x"}], "seed": True},
]
BAD_COMPLETION = [{"prompt": [1, "a"]}, {"prompt": 5}, {}]


def errors() -> None:
    print("\n# the first error for the same bad body\n")
    cases = [(b, ChatBody, MsgspecChat) for b in BAD_CHAT] + [
        (b, CompletionBody, MsgspecCompletion) for b in BAD_COMPLETION]
    for body, pyd, msg in cases:
        print(f"- body: `{json.dumps(body)}`")
        try:
            pyd.model_validate(body)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            print(f"  - pydantic: loc `{first['loc']}`: {first['msg']}")
        try:
            msgspec.json.decode(json.dumps(body).encode(), type=msg)
            print("  - msgspec: accepted")
        except msgspec.ValidationError as exc:
            print(f"  - msgspec: {exc}")
        try:
            read_body(pyd, body, {"vocab_size": 258})
        except ApiError as exc:
            print(f"  - fairtick: param `{exc.param}`: {exc.message}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=500, help="calls per way and round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"pydantic {__import__('pydantic').VERSION}, msgspec {msgspec.__version__}, "
          f"Python {sys.version.split()[0]}\n")
    measure(args.repeats, args.rounds)
    errors()
    return 0


if __name__ == "__main__":
    sys.exit(main())
