"""The server's typed errors (defined in `hybrid_cache.errors`, re-exported here) and the HTTP
status and OpenAI error body of every error a request can meet.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "n", "code": null}}

400 for bad input (a prompt over `max_model_len` has code "context_length_exceeded"), 401 for
a missing or wrong API key, 404 for an unknown model, 413 for a body over the limit, 499 when
the client left before its response (nobody reads it), 503 while the engine is overloaded or
dead, 500 for anything else (a bug: the message says so).
"""

from __future__ import annotations

from typing import Any, Optional

from hybrid_cache.errors import (
    AuthenticationError,
    ClientDisconnectedError,
    EngineDeadError,
    EngineOverloadedError,
    HybridCacheError,
    InsufficientKVCacheError,
    InvalidFieldError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    PromptTooLongError,
    RequestBodyTooLargeError,
    ServerConfigError,
    UnknownServedModelError,
)

__all__ = [
    "AuthenticationError",
    "ClientDisconnectedError",
    "EngineDeadError",
    "EngineOverloadedError",
    "InvalidFieldError",
    "RequestBodyTooLargeError",
    "ServerConfigError",
    "UnknownServedModelError",
    "error_body",
    "error_of",
    "error_status",
]


def error_status(error: BaseException) -> tuple[int, str, Optional[str]]:
    """(HTTP status, OpenAI error type, code) of an error."""
    if isinstance(error, AuthenticationError):
        return 401, "authentication_error", "invalid_api_key"
    if isinstance(error, ClientDisconnectedError):
        return 499, "client_closed_request", None
    if isinstance(error, UnknownServedModelError):
        return 404, "invalid_request_error", "model_not_found"
    if isinstance(error, RequestBodyTooLargeError):
        return 413, "invalid_request_error", "request_too_large"
    if isinstance(error, (PromptTooLongError, InsufficientKVCacheError)):
        return 400, "invalid_request_error", "context_length_exceeded"
    if isinstance(error, (InvalidRequestError, InvalidSamplingParamsError)):
        return 400, "invalid_request_error", None
    if isinstance(error, EngineOverloadedError):
        return 503, "service_unavailable_error", "engine_overloaded"
    if isinstance(error, EngineDeadError):
        return 503, "service_unavailable_error", "engine_unhealthy"
    return 500, "internal_server_error", None


def error_body(
    message: str, error_type: str, param: Optional[str] = None, code: Optional[str] = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_of(error: BaseException) -> tuple[int, dict[str, Any]]:
    """The status and body a request that raised `error` gets."""
    status, error_type, code = error_status(error)
    if status == 500:
        kind = "an internal error" if not isinstance(error, HybridCacheError) else "an error"
        message = f"the server hit {kind} ({type(error).__name__}: {error}); this is a bug"
    else:
        message = str(error)
    param = getattr(error, "param", None)
    if isinstance(error, UnknownServedModelError):
        param = "model"
    return status, error_body(message, error_type, param, code)
