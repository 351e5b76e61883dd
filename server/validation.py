"""Request validation for /v1/completions and /v1/chat/completions, in one place.

`parse_body` turns raw bytes into a JSON object (size, content type, UTF-8, JSON syntax, depth);
`validate_request` checks every field of either endpoint and returns a `ValidRequest` ready for
the engine, or raises `ApiError` naming the field. Nothing here touches the engine, so a bad
request can never reach it. Unknown fields are rejected, as the OpenAI API does. Defaults follow
`SamplingParams` (greedy unless `temperature` is given, no stop strings); `max_tokens` defaults to
16 for completions (OpenAI's default) and to `ModelLimits.default_chat_max_tokens` for chat, each
cut to the room the prompt leaves in the context (`_fit_context`, the one place it is decided).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from runtime.sampling import SamplingParams
from server.errors import ApiError, invalid
from server.fields import (
    check_logit_bias,
    get_bool,
    get_float,
    get_int,
    get_str,
    require_unsupported_default,
)
from server.prompts import is_batch, read_messages, read_prompts

Kind = Literal["completion", "chat"]

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_JSON_DEPTH = 32
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
MAX_SEED = 2**63 - 1
MAX_TOP_K = 2**31 - 1
DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_N = 64  # choices of one prompt (`n`)
MAX_CHOICES = 128  # choices of one request: prompts in a completions batch times `n`
# A chat request without max_tokens: bounded, not the model's whole context (`fairtick serve
# --default-chat-max-tokens`).
DEFAULT_CHAT_MAX_TOKENS = 2048

_COMMON_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
    "stream_options", "n", "min_tokens", "ignore_eos", "logit_bias", "logprobs",
    "presence_penalty", "frequency_penalty", "user",
})
_FIELDS: dict[Kind, frozenset[str]] = {
    "completion": _COMMON_FIELDS | {"prompt", "best_of", "echo", "suffix"},
    "chat": _COMMON_FIELDS | {
        "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
        "tool_choice", "parallel_tool_calls", "metadata", "store",
    },
}


@dataclass(frozen=True)
class ModelLimits:
    """What validation needs to know about the served model: the id it is reported as (`name`),
    the other names requests may use for it, and the server's default for chat max_tokens."""

    name: str
    context_length: int
    vocab_size: int
    aliases: tuple[str, ...] = ()
    default_chat_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name a request may use, the reported id first."""
        return (self.name, *self.aliases)


class PromptEncoder(Protocol):
    def encode_prompt(self, prompt: str) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]: ...


@dataclass(frozen=True)
class ValidPrompt:
    """One prompt of a request, tokenized, with the sampling parameters that fit its context."""

    tokens: tuple[int, ...]
    sampling: SamplingParams


@dataclass(frozen=True)
class ValidRequest:
    """A request that passed every check: its prompts (a completions batch may hold several;
    choice `i * n + j` is choice j of prompt i), tokenized, with their sampling parameters."""

    kind: Kind
    prompts: tuple[ValidPrompt, ...]
    n: int
    stream: bool
    include_usage: bool

    @property
    def prompt_tokens(self) -> tuple[int, ...]:
        """The first (usually the only) prompt's tokens."""
        return self.prompts[0].tokens

    @property
    def sampling(self) -> SamplingParams:
        return self.prompts[0].sampling


def parse_body(body: bytes, content_type: str | None, max_body_bytes: int) -> dict[str, Any]:
    """Decode a request body into a JSON object, or raise a 4xx `ApiError` saying what is wrong."""
    if len(body) > max_body_bytes:
        raise ApiError(413, f"request body is {len(body)} bytes; the limit is {max_body_bytes}",
                       code="request_too_large")
    media_type = (content_type or "application/json").split(";")[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise ApiError(415, f"Content-Type must be application/json, got {media_type!r}",
                       code="unsupported_media_type")
    if not body.strip():
        raise invalid("request body is empty; send a JSON object", None, code="invalid_json")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(f"request body is not valid UTF-8 ({exc.reason} at byte {exc.start})",
                      None, code="invalid_encoding") from None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise invalid(f"request body is not valid JSON: {exc}", None, code="invalid_json") from None
    _check_structure(value)
    if not isinstance(value, dict):
        raise invalid("request body must be a JSON object", None, code="invalid_json")
    return value


def _check_structure(value: Any) -> None:
    """Depth cap; strings that UTF-8 can carry (a lone surrogate escape cannot); finite numbers
    (NaN, Infinity and float literals past 1.8e308 are refused here, naming where they are)."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        item, depth, path = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise invalid(f"JSON is nested deeper than {MAX_JSON_DEPTH} levels", None,
                          code="invalid_json")
        if isinstance(item, str):
            _check_encodable(item)
        elif isinstance(item, float) and not math.isfinite(item):
            raise invalid(f"`{path or 'body'}` must be a finite number, got "
                          f"{_JSON_CONSTANTS[repr(item)]}; NaN, Infinity and numbers beyond "
                          "1.8e308 are not allowed", path or None)
        elif isinstance(item, dict):
            for key, child in item.items():
                _check_encodable(key)
                stack.append((child, depth + 1, f"{path}.{key}" if path else key))
        elif isinstance(item, list):
            stack.extend((child, depth + 1, f"{path}[{i}]") for i, child in enumerate(item))


_JSON_CONSTANTS = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def _check_encodable(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid("a string contains an unpaired surrogate escape (\\ud800-\\udfff)", None,
                      code="invalid_encoding") from None


def validate_request(
    kind: Kind, body: dict[str, Any], limits: ModelLimits, encoder: PromptEncoder
) -> ValidRequest:
    """Check every field of a completions or chat body and tokenize its prompt."""
    for name in body:
        if name not in _FIELDS[kind]:
            raise invalid(f"Unrecognized request argument supplied: {name}", name,
                          code="unknown_parameter")
    _check_model(body, limits)
    _check_unsupported(kind, body, limits)
    stream, include_usage = _read_stream(body)
    n = _read_n(kind, body)
    fields = _read_sampling_fields(kind, body, limits)
    if kind == "completion":
        prompts = read_prompts(body.get("prompt"), limits.vocab_size, encoder)
        params = [f"prompt[{i}]" for i in range(len(prompts))] if is_batch(body["prompt"]) \
            else ["prompt"]
    else:
        prompts, params = [encoder_chat(encoder, read_messages(body.get("messages")))], \
            ["messages"]
    if len(prompts) * n > MAX_CHOICES:
        raise invalid(f"{len(prompts)} prompts times n={n} is {len(prompts) * n} choices; at "
                      f"most {MAX_CHOICES} are allowed in one request", "n")
    requested = fields.pop("max_tokens")
    # A context overflow names the field the client set: chat's newer name wins when both are.
    tokens_param = "max_completion_tokens" if kind == "chat" and \
        body.get("max_completion_tokens") is not None else "max_tokens"
    valid = tuple(_valid_prompt(tokens, requested, fields, kind, limits, (param, tokens_param))
                  for tokens, param in zip(prompts, params, strict=True))
    return ValidRequest(kind, valid, n, stream, include_usage)


def _valid_prompt(tokens: list[int], requested: int | None, fields: dict[str, Any], kind: Kind,
                  limits: ModelLimits, params: tuple[str, str]) -> ValidPrompt:
    max_tokens = _fit_context(len(tokens), requested, kind, limits, params)
    if fields["min_tokens"] > max_tokens:
        raise invalid(f"`min_tokens` ({fields['min_tokens']}) must not exceed max_tokens "
                      f"({max_tokens})", "min_tokens")
    sampling = SamplingParams(max_tokens=max_tokens, **fields)
    try:
        sampling.validate()
    except ValueError as exc:
        raise invalid(str(exc), None) from None
    return ValidPrompt(tuple(tokens), sampling)


def _read_n(kind: Kind, body: dict[str, Any]) -> int:
    # Choices of each prompt, sharing its prefill; `best_of` (completions) only as n itself:
    # this server does not generate extra candidates to rank by likelihood.
    n = get_int(body, "n", 1, MAX_N) or 1
    best_of = get_int(body, "best_of", 1, MAX_N) if kind == "completion" else None
    if best_of is not None and best_of != n:
        raise invalid(f"`best_of` other than `n` ({n}) is not supported: this server does not "
                      "generate extra candidates to rank; send best_of equal to n, or leave it "
                      "out", "best_of", code="unsupported_parameter")
    return n


def encoder_chat(encoder: PromptEncoder, messages: list[dict[str, str]]) -> list[int]:
    try:
        return list(encoder.encode_chat(messages))
    except Exception as exc:  # a template can fail on any content it does not expect
        raise invalid(f"could not apply the chat template: {exc}", "messages") from None


def _check_model(body: dict[str, Any], limits: ModelLimits) -> None:
    name = get_str(body, "model")
    if name is not None:
        check_model_name(name, limits)


def check_model_name(name: str, limits: ModelLimits) -> None:
    """A 404 in OpenAI's shape unless `name` is one of the served names."""
    if name not in limits.served_names:
        served = ", ".join(f"`{n}`" for n in limits.served_names)
        raise ApiError(404, f"The model `{name}` does not exist; this server serves {served}",
                       param="model", code="model_not_found")


def _check_unsupported(kind: Kind, body: dict[str, Any], limits: ModelLimits) -> None:
    check_logit_bias(body, limits.vocab_size)
    require_unsupported_default(body, "presence_penalty", (0, 0.0))
    require_unsupported_default(body, "frequency_penalty", (0, 0.0))
    get_str(body, "user")
    if kind == "completion":
        require_unsupported_default(body, "logprobs", ())
        require_unsupported_default(body, "echo", (False,))
        require_unsupported_default(body, "suffix", ("",))
        return
    require_unsupported_default(body, "logprobs", (False,))
    require_unsupported_default(body, "top_logprobs", (0,))
    require_unsupported_default(body, "response_format", ({"type": "text"},))
    require_unsupported_default(body, "tools", ([],))
    require_unsupported_default(body, "tool_choice", ("none",))
    get_bool(body, "parallel_tool_calls", True)
    get_bool(body, "store", False)
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise invalid("`metadata` must be an object", "metadata")


def _read_stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = get_bool(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise invalid("`stream_options` is only allowed when `stream` is true", "stream_options")
    if not isinstance(options, dict):
        raise invalid("`stream_options` must be an object", "stream_options")
    try:
        include_usage = get_bool(options, "include_usage", False)
    except ApiError:
        raise invalid("`stream_options.include_usage` must be true or false",
                      "stream_options.include_usage") from None
    return stream, include_usage


def _read_sampling_fields(kind: Kind, body: dict[str, Any], limits: ModelLimits) -> dict[str, Any]:
    context = limits.context_length
    max_tokens = get_int(body, "max_tokens", 1, context)
    if kind == "chat":
        max_tokens = get_int(body, "max_completion_tokens", 1, context) or max_tokens
    top_k = get_int(body, "top_k", -1, MAX_TOP_K)
    temperature = get_float(body, "temperature", 0.0, 2.0)
    top_p = get_float(body, "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise invalid("`top_p` must be greater than 0 (1 disables it)", "top_p")
    return {
        "max_tokens": max_tokens,
        "temperature": 0.0 if temperature is None else temperature,
        "top_p": 1.0 if top_p is None else top_p,
        "top_k": 0 if top_k in (None, -1) else min(top_k, limits.vocab_size),
        "seed": get_int(body, "seed", 0, MAX_SEED),
        "min_tokens": get_int(body, "min_tokens", 0, context) or 0,
        "stop": _read_stop(body.get("stop")),
        "ignore_eos": get_bool(body, "ignore_eos", False),
    }


def _read_stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("`stop` must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise invalid(f"`stop` has {len(stops)} sequences; at most {MAX_STOP_SEQUENCES} "
                      "are allowed", "stop")
    for stop in stops:
        if not 1 <= len(stop) <= MAX_STOP_CHARS:
            raise invalid(f"each `stop` sequence must have 1 to {MAX_STOP_CHARS} characters",
                          "stop")
    return tuple(stops)


def _fit_context(
    num_prompt: int, requested: int | None, kind: Kind, limits: ModelLimits,
    params: tuple[str, str],
) -> int:
    """The max_tokens to run with, or a 400 when prompt and completion cannot fit the context."""
    context = limits.context_length
    prompt_param, tokens_param = params
    if num_prompt >= context:
        raise invalid(f"This model's maximum context length is {context} tokens; the "
                      f"{prompt_param} has {num_prompt} tokens, which leaves no room to generate",
                      prompt_param, code="context_length_exceeded")
    room = context - num_prompt
    if requested is None:
        default = (DEFAULT_COMPLETION_MAX_TOKENS if kind == "completion"
                   else limits.default_chat_max_tokens)
        return min(default, room)
    if requested > room:
        raise invalid(f"This model's maximum context length is {context} tokens; you requested "
                      f"{num_prompt + requested} ({num_prompt} in the {prompt_param}, {requested} "
                      f"for the completion). Reduce the prompt or {tokens_param}", tokens_param,
                      code="context_length_exceeded")
    return requested
