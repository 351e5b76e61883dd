"""The Sanic app factory: one engine per app, started before serving and stopped after.

Resources live on `app.ctx`: `config`, `engine`, `limits` (served names, context, vocabulary,
default chat max_tokens), `encoder` (prompt and chat tokenization), `draining` (set when
shutdown begins, new generation requests get 503), `started_at`. Shutdown (SIGTERM, Ctrl-C)
is graceful: in-flight requests finish within `config.stop_grace_s`, the rest are aborted with a
503 error, and the process exits 0. Every error leaves as OpenAI-style JSON (server.errors), and
one that refuses a request the engine never took is counted in `fairtick_requests_refused_total`
by status and reason. An API key and CORS, when configured, are middleware (server.access).
Start-up logs each step (model, KV budget, policy, address); `fairtick serve` configures logging
(server.logs), so Sanic is told to leave it alone.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.metadata
import itertools
import logging
import re
import time
from typing import Any

from sanic import Request, Sanic
from sanic.exceptions import PayloadTooLarge, RequestTimeout, SanicException
from sanic.response import JSONResponse, json

from server.access import install_access
from server.config import ServerConfig
from server.errors import ApiError
from server.model_routes import make_model_blueprint, package_version
from server.openai_format import system_fingerprint
from server.openai_routes import make_openai_blueprint
from server.ops_routes import make_ops_blueprint
from server.prompts import TokenizerEncoder
from server.validation import ModelLimits

log = logging.getLogger("fairtick.server")
_app_numbers = itertools.count(1)
SHUTDOWN_FLUSH_S = 2.0


def create_app(config: ServerConfig, engine: Any | None = None) -> Sanic:
    """A Sanic app serving `engine`, or an engine built from `config.engine` at startup.

    The app owns its engine either way: it starts it (if not running) before serving and stops
    it after the server stops.
    """
    app = Sanic(f"fairtick_{next(_app_numbers)}", configure_logging=False,
                request_class=TimedRequest)
    app.config.REQUEST_TIMEOUT = config.request_timeout_s
    app.config.REQUEST_MAX_SIZE = config.max_body_bytes
    app.config.RESPONSE_TIMEOUT = config.response_timeout_s
    app.config.FALLBACK_ERROR_FORMAT = "json"
    # After the engine has stopped (see _begin_draining) handlers only flush their last events.
    app.config.GRACEFUL_SHUTDOWN_TIMEOUT = SHUTDOWN_FLUSH_S
    # TouchUp rewrites Sanic's own classes once per process; a second app would fail to start.
    app.config.TOUCHUP = False
    app.ctx.config = config
    app.ctx.engine = engine
    app.ctx.draining = False
    app.ctx.fingerprint = None  # system_fingerprint, once the engine's model is known
    app.ctx.started_at = config.created if config.created is not None else int(time.time())
    app.blueprint(make_openai_blueprint())
    app.blueprint(make_model_blueprint())
    app.blueprint(make_ops_blueprint())
    install_access(app, config)
    app.error_handler.add(ApiError, _api_error)
    app.error_handler.add(SanicException, _sanic_error)
    app.error_handler.add(Exception, _unexpected_error)
    app.register_listener(_start_engine, "before_server_start")
    app.register_listener(_log_address, "after_server_start")
    app.register_listener(_begin_draining, "before_server_stop")
    app.register_listener(_stop_engine, "after_server_stop")
    return app


def make_engine(config: ServerConfig) -> Any:
    """Load the model and build the engine (imports MLX; slow for a real model)."""
    from runtime.engine import Engine, EngineConfig
    from runtime.model import load_model

    engine_config = config.engine or EngineConfig()
    where = engine_config.model or "the built-in model"
    log.info("loading %s", where)
    started = time.perf_counter()
    bundle = load_model(engine_config.model)
    log.info("model %s loaded from %s in %.2f s (context %d tokens)", bundle.name, bundle.path,
             time.perf_counter() - started, bundle.context_length)
    started = time.perf_counter()
    engine = Engine(engine_config, bundle)
    log.info("engine built in %.2f s", time.perf_counter() - started)
    return engine


def model_limits(bundle: Any, config: ServerConfig | None = None,
                 kv_budget_tokens: int | None = None) -> ModelLimits:
    """Served names, context length and vocabulary size of a loaded ModelBundle, with the
    chat max_tokens default of `config` and the engine's KV budget. With no served names
    configured the model is served as its directory's name."""
    config = config or ServerConfig()
    name, *aliases = config.served_model_names or (bundle.name,)
    return ModelLimits(name, int(bundle.context_length), bundle.vocab_size, tuple(aliases),
                       config.default_chat_max_tokens, kv_budget_tokens)


async def _start_engine(app: Sanic) -> None:
    if app.ctx.engine is None:
        app.ctx.engine = make_engine(app.ctx.config)
    engine = app.ctx.engine
    if not engine.alive:
        engine.start()
    # What start-up built (the model's modules, the tokenizer, the app: ~100,000 objects with
    # the built-in model) lives as long as the server. Frozen, a full collection no longer walks
    # it: one took 70-76 ms, the engine thread stopped for all of it (every stream's gap ~10x
    # its 4-stream step), and serving brings one now and then (in-process, one landed in an
    # admission's tick: 82 ms against its 19 ms target).
    gc.collect()
    gc.freeze()
    app.ctx.limits = model_limits(engine.bundle, app.ctx.config, engine.kv.tokens)
    app.ctx.encoder = TokenizerEncoder(engine.bundle.tokenizer)
    app.ctx.fingerprint = system_fingerprint(package_version(), engine.bundle.name,
                                             importlib.metadata.version("mlx"), _blas_config())
    log.info("KV budget: %s; up to %d sequences running", engine.kv.describe(),
             engine.layout.max_running)
    params = " ".join(f"{name}={value:g}" for name, value in sorted(engine.params.items()))
    log.info("serving %s with policy %s (%s)", " = ".join(app.ctx.limits.served_names),
             engine.policy.name, params or "no parameters")


def _blas_config() -> str:
    # Which BLAS computes the products (their last bits differ between builds); not its path.
    from runtime.blas import load_blas

    blas = load_blas()
    return blas.config if blas.optimized else "reference"


async def _log_address(app: Sanic) -> None:
    # Known when Sanic runs the server (`app.run`); a caller of `create_server` knows it itself.
    if app.state.server_info:
        log.info("listening on %s", app.serve_location)


async def _begin_draining(app: Sanic) -> None:
    # Runs while the server still serves its connections: new generation requests get 503, the
    # in-flight ones may finish for the grace period, then the engine stops and ends the rest
    # with "abort", which their handlers still send (a 503 error, in-band for a stream).
    app.ctx.draining = True
    if app.ctx.engine is not None:
        await asyncio.get_running_loop().run_in_executor(
            None, app.ctx.engine.stop, app.ctx.config.stop_grace_s)


async def _stop_engine(app: Sanic) -> None:
    if app.ctx.engine is not None:
        app.ctx.engine.stop(grace_s=0)


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return _answer(request, exc)


class TimedRequest(Request):
    """A request whose body must arrive within the request timeout. Sanic reads a body before
    the handler, in the handler's stage, where only the response timeout (an hour: a whole
    generation may queue that long) applied: a client that sent its headers and stalled held
    the connection for it. On time-out: 408, and the connection closes (its body unread)."""

    async def receive_body(self) -> None:
        http = self.stream
        declared = self.headers.get("content-length", "")
        if http is not None and getattr(http, "expecting_continue", False) and \
                declared.isdigit() and int(declared) > self.app.config.REQUEST_MAX_SIZE:
            # The client waits for "100 Continue" before it sends the body: a body declared
            # over the limit is refused now (RFC 9110 10.1.1), not after it was sent whole.
            http.expecting_continue, http.keep_alive, http.request_body = False, False, None
            raise PayloadTooLarge("Request body exceeds the size limit")
        timeout_s = self.app.config.REQUEST_TIMEOUT
        try:
            await asyncio.wait_for(super().receive_body(), timeout_s)
        except asyncio.TimeoutError:
            http = self.stream
            if http is not None:  # answer, then close without reading the rest
                http.keep_alive, http.request_body = False, None
            raise RequestTimeout(f"the request body did not arrive within {timeout_s:g} s "
                                 "(send it whole)") from None


async def _sanic_error(request: Request, exc: SanicException) -> JSONResponse:
    name = type(exc).__name__
    message = str(exc) or name
    if exc.status_code == 413:  # Sanic's check of the declared length, before any route
        message = (f"{message}: the limit is {request.app.config.REQUEST_MAX_SIZE} bytes "
                   "(--max-body-bytes)")
    error = ApiError(exc.status_code, message,
                     code=re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower(),
                     headers=getattr(exc, "headers", None))
    return _answer(request, error)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.path)
    return _answer(request, ApiError(500, f"Internal server error: {type(exc).__name__}",
                                     code="internal_error"))


def _answer(request: Request, error: ApiError) -> JSONResponse:
    # A request the engine took is counted by the engine, as finished or aborted.
    engine = request.app.ctx.engine
    if engine is not None and not getattr(request.ctx, "accepted", False):
        engine.metrics.requests_refused.labels(str(error.status), refusal_reason(error)).inc()
    return json(error.to_body(), status=error.status, headers=error.headers)


def refusal_reason(error: ApiError) -> str:
    """The `reason` label of a refusal: the error's code, else its type."""
    return error.code or error.error_type
