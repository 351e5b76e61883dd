"""Request validation for /v1/completions and /v1/chat/completions: each step once, in order.

1. `parse_body`: bytes to a JSON object (size, content type, UTF-8, JSON syntax, depth, finite
   numbers).
2. `read_body` (server/body_reading.py): the object to its model (server/body_models.py), every
   field's shape and range and token ids inside the vocabulary, or a 400 naming the field path;
   unknown fields are kept aside, to be ignored and reported (ADR 0010).
3. `_check_consistency`: fields that constrain each other.
4. `refuse_unimplemented` (server/unimplemented.py): fields declared but not done yet.
5. The served model: its name, the prompt's tokens (a chat's with the `tools` it offers:
   server/tool_request.py), the context (`runtime.limits.fit_context`, the one context check)
   and the engine's `SamplingParams` (server/sampling_fields.py).
6. The grammar fields (server/response_format.py `check_grammar_fields`); the grammar itself is
   compiled by the route, off the event loop.

Nothing here touches the engine or imports MLX, so a bad request never reaches the engine.
Defaults: greedy unless `temperature` is given, no stop strings, no sampling control (min_p,
penalties, logit_bias) and no log-probabilities unless asked; `max_tokens` 16 for completions
(OpenAI's default) and `ModelLimits.default_chat_max_tokens` for chat, each cut to the room the
prompt leaves in the context.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from runtime import limits as lim
from runtime.formats import ResponseFormat
from runtime.limits import ContextOverflow, fit_context
from runtime.sampling_params import SamplingParams
from server.body_models import VOCAB, ChatBody, CompletionBody
from server.body_reading import ignored_fields, read_body
from server.errors import ApiError, invalid
from server.messages import prompt_messages
from server.response_format import check_grammar_fields, read_response_format
from server.sampling_fields import sampling_params
from server.tool_request import ToolRequest, chat_inputs, read_tool_request
from server.unimplemented import refuse_unimplemented

Kind = Literal["completion", "chat"]

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_JSON_DEPTH = 32
DEFAULT_CHAT_MAX_TOKENS = lim.DEFAULT_CHAT_MAX_TOKENS
BODY_MODELS: dict[Kind, type[CompletionBody] | type[ChatBody]] = {
    "completion": CompletionBody, "chat": ChatBody}
MAX_N, MAX_CHOICES = lim.MAX_N, lim.MAX_CHOICES


@dataclass(frozen=True)
class ModelLimits:
    """What validation needs to know about the served model: the id it is reported as (`name`),
    the other names requests may use for it, and the server's default for chat max_tokens."""

    name: str
    context_length: int
    vocab_size: int
    aliases: tuple[str, ...] = ()
    default_chat_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS
    # The engine's KV token budget: a request's prompt plus max_tokens must fit it (None: no
    # budget known). A max_tokens the request leaves out is cut to the room it leaves.
    kv_budget_tokens: int | None = None

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name a request may use, the reported id first."""
        return (self.name, *self.aliases)

    @property
    def context(self) -> dict[str, Any]:
        """The pydantic validation context the body models check token ids with."""
        return {VOCAB: self.vocab_size}


class PromptEncoder(Protocol):
    @property
    def chat_template(self) -> str | None: ...

    def encode_prompt(self, prompt: str) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    add_special_tokens: bool | None = None,
                    tools: list[dict[str, Any]] | None = None) -> list[int]: ...


@dataclass(frozen=True)
class ValidPrompt:
    """One prompt of a request, tokenized, with the sampling parameters that fit its context;
    `text`: the prompt as sent when it was a string (what `echo` returns)."""

    tokens: tuple[int, ...]
    sampling: SamplingParams
    text: str | None = None


@dataclass(frozen=True)
class ValidRequest:
    """A request that passed every check: its prompts (a completions batch may hold several;
    choice `i * n + j` is choice j of prompt i), tokenized, with their sampling parameters, and
    the paths of the unknown fields it sent (ignored)."""

    kind: Kind
    prompts: tuple[ValidPrompt, ...]
    n: int
    stream: bool
    include_usage: bool
    ignored: tuple[str, ...] = ()
    cache_prompt: bool = True  # false: the request neither reuses nor leaves a cached prefix
    echo: bool = False  # completions: each choice's text starts with its prompt
    response_format: ResponseFormat | None = None  # compiled by the route, off the event loop
    tools: ToolRequest | None = None  # the tools a chat offers (None: none, or "none")

    @property
    def prompt_tokens(self) -> tuple[int, ...]:
        """The first (usually the only) prompt's tokens."""
        return self.prompts[0].tokens

    @property
    def sampling(self) -> SamplingParams:
        return self.prompts[0].sampling


def parse_request_body(request: Any) -> dict[str, Any]:
    """`parse_body` of a Sanic request, under its headers and the server's body limit."""
    return parse_body(request.body, request.headers.get("content-type"),
                      request.app.ctx.config.max_body_bytes,
                      request.headers.get("content-encoding"))


def parse_body(body: bytes, content_type: str | None, max_body_bytes: int,
               content_encoding: str | None = None) -> dict[str, Any]:
    """Decode a request body into a JSON object, or raise a 4xx `ApiError` saying what is wrong."""
    coding = (content_encoding or "identity").strip().lower()
    if coding != "identity":  # a compressed body read as JSON gave a misleading 400
        raise ApiError(415, f"Content-Encoding {coding!r} is not supported: send the body "
                       "uncompressed", code="unsupported_media_type")
    if len(body) > max_body_bytes:
        raise ApiError(413, f"request body is {len(body)} bytes; the limit is {max_body_bytes} "
                       "(--max-body-bytes)",
                       code="payload_too_large")
    media_type = (content_type or "application/json").split(";")[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise ApiError(415, f"Content-Type must be application/json, got {media_type!r}",
                       code="unsupported_media_type")
    if not body.strip():
        raise invalid("request body is empty; send a JSON object", None, code="invalid_json")
    try:
        # A UTF-8 byte order mark, which JSON parsers may ignore (RFC 8259 8.1) and some
        # Windows clients send, is ignored.
        text = body.decode("utf-8").removeprefix("\ufeff")
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
    # A path is None at the body itself; "" is a key of that name (a field called "").
    stack: list[tuple[Any, int, str | None]] = [(value, 1, None)]
    while stack:
        item, depth, path = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise invalid(f"JSON is nested deeper than {MAX_JSON_DEPTH} levels", None,
                          code="invalid_json")
        if isinstance(item, str):
            _check_encodable(item)
        elif isinstance(item, float) and not math.isfinite(item):
            where = "body" if path is None else path or '""'
            raise invalid(f"`{where}` must be a finite number, got "
                          f"{_JSON_CONSTANTS[repr(item)]}; NaN, Infinity and numbers beyond "
                          "1.8e308 are not allowed", path)
        elif isinstance(item, dict):
            for key, child in item.items():
                _check_encodable(key)
                stack.append((child, depth + 1, key if path is None else f"{path}.{key}"))
        elif isinstance(item, list):
            stack.extend((child, depth + 1, f"{path or ''}[{i}]") for i, child in enumerate(item))


_JSON_CONSTANTS = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def _check_encodable(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid("a string contains an unpaired surrogate escape (\\ud800-\\udfff)", None,
                      code="invalid_encoding") from None


def validate_request(
    kind: Kind, data: dict[str, Any], limits: ModelLimits, encoder: PromptEncoder
) -> ValidRequest:
    """Check every field of a completions or chat body and tokenize its prompt."""
    body = read_body(BODY_MODELS[kind], data, limits.context)
    _check_consistency(body)
    refuse_unimplemented(kind, body)
    if body.model is not None:
        check_model_name(body.model, limits)
    n = body.n or 1
    tools = read_tool_request(body) if isinstance(body, ChatBody) else None
    response_format = read_response_format(body.response_format)
    check_grammar_fields(response_format, tools, body.min_tokens, body.ignore_eos)
    if isinstance(body, CompletionBody):
        prompts = read_prompts(body.prompt, encoder)
        texts = _prompt_texts(body.prompt)
    else:
        prompts = [(encoder_chat(encoder, prompt_messages(body.messages), tools), "messages")]
        texts = [None]
    if len(prompts) * n > MAX_CHOICES:
        raise invalid(f"{len(prompts)} prompts times n={n} is {len(prompts) * n} choices; at "
                      f"most {MAX_CHOICES} are allowed in one request", "n")
    valid = tuple(_valid_prompt(tokens, param, body, limits, text)
                  for (tokens, param), text in zip(prompts, texts, strict=True))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    echo = isinstance(body, CompletionBody) and bool(body.echo)
    return ValidRequest(kind, valid, n, bool(body.stream), include_usage,
                        tuple(ignored_fields(body)), body.cache_prompt is not False, echo,
                        response_format, tools)


def _valid_prompt(tokens: list[int], prompt_param: str, body: CompletionBody | ChatBody,
                  limits: ModelLimits, text: str | None) -> ValidPrompt:
    """One prompt with the max_tokens its context leaves room for."""
    max_tokens = _fit_context(len(tokens), body, limits, prompt_param)
    if (body.min_tokens or 0) > max_tokens:
        raise invalid(f"`min_tokens` ({body.min_tokens}) must not exceed max_tokens "
                      f"({max_tokens})", "min_tokens")
    return ValidPrompt(tuple(tokens), sampling_params(body, max_tokens, limits.vocab_size), text)


def _prompt_texts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | None]:
    """Each prompt of a completions `prompt` as sent, where it is a string (read_prompts'
    order)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], (str, list)):
        return [p if isinstance(p, str) else None for p in prompt]
    return [None]


def _check_consistency(body: CompletionBody | ChatBody) -> None:
    """Fields that constrain each other."""
    if body.stream_options is not None and not body.stream:
        raise invalid("`stream_options` is only allowed when `stream` is true", "stream_options")
    if isinstance(body, CompletionBody):
        if body.best_of is not None and body.best_of < (body.n or 1):
            raise invalid(f"`best_of` ({body.best_of}) must be at least `n` ({body.n})",
                          "best_of")
    elif body.top_logprobs and not body.logprobs:
        raise invalid("`top_logprobs` needs `logprobs` set to true", "top_logprobs")


def read_prompts(prompt: str | list[str] | list[int] | list[list[int]],
                 encoder: PromptEncoder) -> list[tuple[list[int], str]]:
    """Each prompt of a completions `prompt` as (token ids, the param an error names): one, or
    a batch of strings or token-id lists (`prompt[i]`). The model checked the shapes, the
    batch's size and the ids."""
    if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
        return [(read_prompt(p, encoder, f"prompt[{i}]"), f"prompt[{i}]")
                for i, p in enumerate(prompt)]
    return [(read_prompt(prompt, encoder), "prompt")]  # type: ignore[arg-type]


def read_prompt(prompt: str | list[int], encoder: PromptEncoder,
                param: str = "prompt") -> list[int]:
    """The token ids of one prompt: a string encoded, or its token ids."""
    tokens = list(encoder.encode_prompt(prompt)) if isinstance(prompt, str) else list(prompt)
    if not tokens:
        raise invalid(f"`{param}` must not be empty", param)
    return tokens


def encoder_chat(encoder: PromptEncoder, messages: list[dict[str, Any]],
                 tools: ToolRequest | None = None) -> list[int]:
    """The chat prompt's tokens, with the tools it offers; a template that fails on the
    messages is a 400."""
    rendered, specs = chat_inputs(messages, tools, encoder.chat_template)
    try:
        return list(encoder.encode_chat(rendered, tools=specs))
    except Exception as exc:  # a template can fail on any content it does not expect
        raise invalid(f"could not apply the chat template: {exc}", "messages") from None


def check_model_name(name: str, limits: ModelLimits) -> None:
    """A 404 in OpenAI's shape unless `name` is one of the served names."""
    if name not in limits.served_names:
        served = ", ".join(f"`{n}`" for n in limits.served_names)
        raise ApiError(404, f"The model `{name}` does not exist; this server serves {served}",
                       param="model", code="model_not_found")


def _fit_context(num_prompt: int, body: CompletionBody | ChatBody, limits: ModelLimits,
                 prompt_param: str) -> int:
    """The max_tokens to run with, or a 400 naming the prompt or the field the client set."""
    requested, tokens_param = body.max_tokens, "max_tokens"
    if isinstance(body, ChatBody) and body.max_completion_tokens is not None:
        requested, tokens_param = body.max_completion_tokens, "max_completion_tokens"
    default = (lim.DEFAULT_COMPLETION_MAX_TOKENS if isinstance(body, CompletionBody)
               else limits.default_chat_max_tokens)
    budget = limits.kv_budget_tokens
    if budget is not None and num_prompt < budget:
        # A default never asks more than the KV budget leaves: a request that sends no
        # max_tokens runs if its prompt fits (the engine refuses one that sent too many).
        default = min(default, budget - num_prompt)
    try:
        return fit_context(num_prompt, requested, default, limits.context_length)
    except ContextOverflow as exc:
        context = limits.context_length
        if exc.leaves_no_room:
            raise invalid(f"This model's maximum context length is {context} tokens; the "
                          f"{num_prompt} tokens of the {prompt_param} leave no room to "
                          "generate", prompt_param, code="context_length_exceeded") from None
        raise invalid(f"This model's maximum context length is {context} tokens; you requested "
                      f"{num_prompt + (requested or 0)} ({num_prompt} in the {prompt_param}, "
                      f"{requested} for the completion). Reduce the prompt or {tokens_param}",
                      tokens_param, code="context_length_exceeded") from None
