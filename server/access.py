"""Who may call the server: a bearer key (`--api-key`) and browsers of other origins (CORS).

Both are Sanic middleware that `install_access` adds only when configured: with neither flag a
request passes untouched and no response carries an `Access-Control-*` header. Sanic runs an
app's request middleware also for a request no route matches, so a CORS preflight (`OPTIONS`
with `Access-Control-Request-Method`, which no route declares) is answered here with 204 before
routing would answer 405, and before the key check, since browsers send preflights without
credentials. Response middleware sees every response (whole, streamed, error), so a 401 or a 429
reaches a browser page readable too.

A small middleware rather than sanic-ext's CORS: once sanic-ext is installed Sanic extends every
app with all of it at start-up (its `AUTO_EXTEND` default: OpenAPI routes, validation,
dependency injection), for what takes ~40 lines here.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from sanic import Request, Sanic
from sanic.response import HTTPResponse, empty

from server.config import ServerConfig
from server.errors import ApiError

# Open without the key unless `api_key_protect_ops`: probes, scrapers and `fairtick trace`.
OPS_PATHS = frozenset({"/health", "/metrics", "/version"})
OPS_PREFIXES = ("/debug/",)
ALLOWED_METHODS = "GET, POST, OPTIONS"
# What a page may read from a response besides the CORS-safelisted headers.
EXPOSED_HEADERS = "X-Request-Id, Retry-After, fairtick-ignored-fields"
PREFLIGHT_MAX_AGE_S = 600

Middleware = Callable[..., Awaitable[HTTPResponse | None]]


def install_access(app: Sanic, config: ServerConfig) -> None:
    """Add the CORS and API-key middleware that `config` asks for (CORS first: a preflight is
    answered before the key is asked for)."""
    if config.allowed_origins:
        cors = CorsPolicy(config.allowed_origins)
        app.register_middleware(_make_preflight(cors), "request")
        app.register_middleware(_make_cors_headers(cors), "response")
    if config.api_key is not None:
        app.register_middleware(_make_key_check(config.api_key, config.api_key_protect_ops),
                                "request")


@dataclass(frozen=True)
class CorsPolicy:
    """The origins whose pages may call the API; `*` allows any."""

    origins: tuple[str, ...]

    def allows(self, origin: str | None) -> bool:
        return origin is not None and ("*" in self.origins or origin in self.origins)

    def headers(self, origin: str) -> dict[str, str]:
        """The headers of a response to an allowed `origin`."""
        if "*" in self.origins:
            return {"Access-Control-Allow-Origin": "*",
                    "Access-Control-Expose-Headers": EXPOSED_HEADERS}
        # The answer depends on the request's Origin: caches must keep one copy per origin.
        return {"Access-Control-Allow-Origin": origin, "Vary": "Origin",
                "Access-Control-Expose-Headers": EXPOSED_HEADERS}


def is_preflight(request: Request) -> bool:
    return request.method == "OPTIONS" and "access-control-request-method" in request.headers


def _make_preflight(cors: CorsPolicy) -> Middleware:
    async def preflight(request: Request) -> HTTPResponse | None:
        if not is_preflight(request):
            return None
        # Answered before routing, which reads a body: read it here (`Content-Length: 0`, as
        # Python's `requests` sends), or Sanic logs an ERROR "body not consumed" after a 204.
        await request.receive_body()
        origin = request.headers.get("origin")
        if not cors.allows(origin):
            raise ApiError(403, f"CORS: origin {origin!r} may not call this server; allowed: "
                           f"{', '.join(cors.origins)} (fairtick serve --allowed-origins)",
                           code="cors_origin_not_allowed")
        asked = request.headers.get("access-control-request-headers")
        return empty(status=204, headers={
            **cors.headers(str(origin)),
            "Access-Control-Allow-Methods": ALLOWED_METHODS,
            "Access-Control-Allow-Headers": asked or "Authorization, Content-Type",
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
        })

    return preflight


def _make_cors_headers(cors: CorsPolicy) -> Middleware:
    async def add_cors_headers(request: Request, response: HTTPResponse) -> None:
        origin = request.headers.get("origin")
        if cors.allows(origin):
            response.headers.update(cors.headers(str(origin)))

    return add_cors_headers


def _make_key_check(api_key: str, protect_ops: bool) -> Middleware:
    expected = api_key.encode()

    async def check_key(request: Request) -> None:
        if is_preflight(request) or (not protect_ops and is_ops_path(request.path)):
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise _unauthorized("Missing API key: send it as `Authorization: Bearer <key>`")
        # Constant time: how much of a guess matched must not show in the response time.
        if not hmac.compare_digest(token.encode("utf-8", "surrogateescape"), expected):
            raise _unauthorized("Incorrect API key provided")

    return check_key


def is_ops_path(path: str) -> bool:
    return path in OPS_PATHS or path.startswith(OPS_PREFIXES)


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key", error_type="invalid_request_error",
                    headers={"WWW-Authenticate": "Bearer"})
