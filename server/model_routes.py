"""What the server serves: its model cards, its tokenizer and its version.

`GET /v1/models` lists one card per served name (the reported id first), `GET /v1/models/{id}`
returns one (404 in OpenAI's shape for any other id). `POST /tokenize` and `POST /detokenize`
follow vLLM's shapes: `{"prompt"}` or `{"messages"}` -> `{"count", "max_model_len", "tokens"}`
(plus `token_strs` when `return_token_strs` asks), `{"tokens"}` -> `{"prompt"}`. Messages become
tokens exactly as the chat endpoint turns them into its prompt, so `count` is the
`usage.prompt_tokens` a chat request with those messages reports. `GET /version` is fairtick's
package version.
"""

from __future__ import annotations

import importlib.metadata
import urllib.parse
from typing import Any

from sanic import Blueprint, Request
from sanic.response import JSONResponse, json

from server.errors import invalid
from server.fields import get_bool, get_str, is_int, show
from server.prompts import TokenizerEncoder, read_messages
from server.validation import ModelLimits, check_model_name, parse_body

TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens",
                             "add_generation_prompt", "return_token_strs"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def make_model_blueprint() -> Blueprint:
    """Model cards, tokenizer and version routes; a new blueprint per app."""
    bp = Blueprint("models")
    bp.add_route(models, "/v1/models", methods=["GET"])
    # `path`: a hub-style id has a slash, sent as is by curl and as %2F by the openai SDK.
    bp.add_route(model, "/v1/models/<model_id:path>", methods=["GET"])
    bp.add_route(tokenize, "/tokenize", methods=["POST"])
    bp.add_route(detokenize, "/detokenize", methods=["POST"])
    bp.add_route(version, "/version", methods=["GET"])
    return bp


def model_card(name: str, limits: ModelLimits, created: int) -> dict[str, Any]:
    """OpenAI's model object for one served name, with vLLM's `max_model_len`."""
    return {"id": name, "object": "model", "created": created, "owned_by": "fairtick",
            "max_model_len": limits.context_length}


async def models(request: Request) -> JSONResponse:
    ctx = request.app.ctx
    cards = [model_card(name, ctx.limits, ctx.started_at) for name in ctx.limits.served_names]
    return json({"object": "list", "data": cards})


async def model(request: Request, model_id: str) -> JSONResponse:
    ctx = request.app.ctx
    name = urllib.parse.unquote(model_id)
    check_model_name(name, ctx.limits)
    return json(model_card(name, ctx.limits, ctx.started_at))


async def version(request: Request) -> JSONResponse:
    return json({"version": package_version()})


def package_version() -> str:
    """fairtick's installed version (pyproject.toml's `version`)."""
    try:
        return importlib.metadata.version("fairtick")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree never installed
        return "0+unknown"


async def tokenize(request: Request) -> JSONResponse:
    """vLLM's /tokenize: a completions `prompt` or chat `messages` to token ids."""
    ctx = request.app.ctx
    body = _read_body(request, TOKENIZE_FIELDS)
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise invalid("send either `prompt` (a string) or `messages` (a chat), not both or "
                      "neither", "messages" if has_prompt else "prompt")
    if has_prompt:
        tokens = _tokenize_prompt(body, ctx.encoder)
    else:
        tokens = _tokenize_messages(body, ctx.encoder)
    reply: dict[str, Any] = {"count": len(tokens), "max_model_len": ctx.limits.context_length,
                             "tokens": tokens}
    if get_bool(body, "return_token_strs", False):
        reply["token_strs"] = ctx.encoder.token_strs(tokens)
    return json(reply)


def _tokenize_prompt(body: dict[str, Any], encoder: TokenizerEncoder) -> list[int]:
    if body.get("add_generation_prompt") is not None:
        raise invalid("`add_generation_prompt` applies to `messages` only",
                      "add_generation_prompt")
    prompt = body["prompt"]
    if not isinstance(prompt, str):
        raise invalid(f"`prompt` must be a string, got {show(prompt)}", "prompt")
    # True by default, as the completions endpoint encodes its prompt.
    return encoder.encode_prompt(prompt, get_bool(body, "add_special_tokens", True))


def _tokenize_messages(body: dict[str, Any], encoder: TokenizerEncoder) -> list[int]:
    messages = read_messages(body["messages"])
    add_generation_prompt = get_bool(body, "add_generation_prompt", True)
    # Absent: what the chat endpoint does (TokenizerEncoder.encode_chat).
    special = (None if body.get("add_special_tokens") is None
               else get_bool(body, "add_special_tokens", False))
    try:
        return encoder.encode_chat(messages, add_generation_prompt, special)
    except Exception as exc:  # a template can fail on any content it does not expect
        raise invalid(f"could not apply the chat template: {exc}", "messages") from None


async def detokenize(request: Request) -> JSONResponse:
    """vLLM's /detokenize: token ids, each checked against the vocabulary, to text."""
    ctx = request.app.ctx
    body = _read_body(request, DETOKENIZE_FIELDS)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise invalid(f"`tokens` must be a list of token ids, got {show(tokens)}", "tokens")
    vocab_size = ctx.limits.vocab_size
    for index, token in enumerate(tokens):
        if not (is_int(token) and 0 <= token < vocab_size):
            raise invalid(f"`tokens[{index}]` must be a token id in [0, {vocab_size}), got "
                          f"{show(token)}", "tokens")
    try:
        text = ctx.encoder.decode(tokens)
    except Exception as exc:  # an id the model has a row for but its tokenizer does not know
        raise invalid(f"could not decode `tokens`: {exc}", "tokens") from None
    return json({"prompt": text})


def _read_body(request: Request, fields: frozenset[str]) -> dict[str, Any]:
    """The JSON body with only `fields`, its `model` (if any) one of the served names."""
    ctx = request.app.ctx
    body = parse_body(request.body, request.headers.get("content-type"),
                      ctx.config.max_body_bytes)
    for name in body:
        if name not in fields:
            raise invalid(f"Unrecognized request argument supplied: {name}; allowed: "
                          f"{', '.join(sorted(fields))}", name, code="unknown_parameter")
    name = get_str(body, "model")
    if name is not None:
        check_model_name(name, ctx.limits)
    return body
