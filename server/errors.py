"""OpenAI-style API errors: one exception type, one JSON shape, for every surface.

Every error a client can see is `{"error": {"message", "type", "param", "code"}}` with an HTTP
status that says whose fault it was (4xx: the request, 429: come back later, 5xx: ours).
"""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error answered to the client as OpenAI-style JSON with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or default_error_type(status)
        self.headers = headers or {}

    def to_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


def default_error_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def invalid(message: str, param: str | None, code: str | None = None) -> ApiError:
    """A 400 for a request field that fails validation."""
    return ApiError(400, message, param=param, code=code)
