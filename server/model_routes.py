"""What the server serves: its model cards, its tokenizer and its version.

`GET /v1/models` lists one card per served name (the reported id first), `GET /v1/models/{id}`
returns one (404 in OpenAI's shape for any other id). `POST /tokenize` and `POST /detokenize`
follow vLLM's shapes: `{"prompt"}` or `{"messages"}` -> `{"count", "max_model_len", "tokens"}`
(plus `token_strs` when `return_token_strs` asks), `{"tokens"}` -> `{"prompt"}`. Messages become
tokens exactly as the chat endpoint turns them into its prompt (with the `tools` offered, as a
chat with `tool_choice` "auto" offers them), so `count` is the `usage.prompt_tokens` a chat
request with those messages and tools reports. The bodies are models of
server/body_models.py; unknown fields are ignored and named in `fairtick-ignored-fields`, as
on the generation endpoints. `GET /version` is fairtick's package version. Each GET route answers
HEAD too (server.ops_routes.GET_METHODS).
"""

from __future__ import annotations

import importlib.metadata
import urllib.parse
from typing import Any

from sanic import Blueprint, Request
from sanic.response import JSONResponse, json

from server.body_models import DetokenizeBody, TokenizeBody
from server.body_reading import Body, ignored_fields, ignored_header, log_ignored, read_body
from server.errors import invalid
from server.messages import prompt_messages
from server.ops_routes import GET_METHODS
from server.prompts import TokenizerEncoder
from server.tool_request import chat_inputs, read_tool_request
from server.unimplemented import declared, refuse_unimplemented
from server.validation import ModelLimits, check_model_name, parse_request_body


def make_model_blueprint() -> Blueprint:
    """Model cards, tokenizer and version routes; a new blueprint per app."""
    bp = Blueprint("models")
    bp.add_route(models, "/v1/models", methods=GET_METHODS)
    # `path`: a hub-style id has a slash, sent as is by curl and as %2F by the openai SDK.
    bp.add_route(model, "/v1/models/<model_id:path>", methods=GET_METHODS)
    bp.add_route(tokenize, "/tokenize", methods=["POST"])
    bp.add_route(detokenize, "/detokenize", methods=["POST"])
    bp.add_route(version, "/version", methods=GET_METHODS)
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
    # A trailing slash, which every other route takes: /v1/models/ lists, /v1/models/{id}/ is
    # the model (a served name may hold a slash, so only one that is not served loses it).
    if name == "":
        return await models(request)
    if name.endswith("/") and name not in ctx.limits.served_names:
        name = name[:-1]
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
    body, ignored = _read_body(request, TokenizeBody)
    refuse_unimplemented("tokenize", body)
    if (body.prompt is None) == (body.messages is None):
        raise invalid("send either `prompt` (a string) or `messages` (a chat), not both or "
                      "neither", "messages" if body.prompt is not None else "prompt")
    if body.prompt is not None:
        tokens = _tokenize_prompt(body, ctx.encoder)
    else:
        tokens = _tokenize_messages(body, ctx.encoder)
    reply: dict[str, Any] = {"count": len(tokens), "max_model_len": ctx.limits.context_length,
                             "tokens": tokens}
    if body.return_token_strs:
        reply["token_strs"] = ctx.encoder.token_strs(tokens)
    return json(reply, headers=ignored_header(ignored))


def _tokenize_prompt(body: TokenizeBody, encoder: TokenizerEncoder) -> list[int]:
    if body.add_generation_prompt is not None:
        raise invalid("`add_generation_prompt` applies to `messages` only",
                      "add_generation_prompt")
    # True by default, as the completions endpoint encodes its prompt.
    special = True if body.add_special_tokens is None else body.add_special_tokens
    return encoder.encode_prompt(str(body.prompt), special)


def _tokenize_messages(body: TokenizeBody, encoder: TokenizerEncoder) -> list[int]:
    messages, tools = chat_inputs(prompt_messages(body.messages or []), read_tool_request(body),
                                  encoder.chat_template)
    add_generation_prompt = body.add_generation_prompt is not False
    # Absent: what the chat endpoint does (TokenizerEncoder.encode_chat).
    try:
        return encoder.encode_chat(messages, add_generation_prompt, body.add_special_tokens,
                                   tools)
    except Exception as exc:  # a template can fail on any content it does not expect
        raise invalid(f"could not apply the chat template: {exc}", "messages") from None


async def detokenize(request: Request) -> JSONResponse:
    """vLLM's /detokenize: token ids, each checked against the vocabulary, to text."""
    body, ignored = _read_body(request, DetokenizeBody)
    try:
        text = request.app.ctx.encoder.decode(body.tokens)
    except Exception as exc:  # an id the model has a row for but its tokenizer does not know
        raise invalid(f"could not decode `tokens`: {exc}", "tokens") from None
    return json({"prompt": text}, headers=ignored_header(ignored))


def _read_body(request: Request, model: type[Body]) -> tuple[Body, list[str]]:
    """The JSON body as `model`, its `model` field (if any) one of the served names, and the
    unknown fields it sent (ignored, logged)."""
    ctx = request.app.ctx
    data = parse_request_body(request)
    body = read_body(model, data, ctx.limits.context)
    name = declared(body, "model")
    if name is not None:
        check_model_name(name, ctx.limits)
    ignored = ignored_fields(body)
    log_ignored(request.path, ignored)
    return body, ignored
