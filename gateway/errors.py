"""The gateway's error hierarchy and its single mapping to OpenAI-format HTTP responses."""

from __future__ import annotations

import sqlite3
from typing import Any

import structlog
from litestar import Request, Response
from litestar.exceptions import HTTPException
from sqlalchemy.exc import DBAPIError

from gateway.audit_hook import AuditUnavailableError
from gateway.storage.db import is_db_full, is_db_unavailable

log = structlog.get_logger()

_TYPES_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class GatewayError(Exception):
    """Base of every error the gateway turns into an HTTP response."""

    status_code = 500
    error_type = "server_error"
    default_code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.param = param
        self.headers = headers or {}


class ServiceUnavailable(GatewayError):
    status_code = 503
    error_type = "server_error"
    default_code = "service_unavailable"


class EngineOverloaded(ServiceUnavailable):
    """Every place for a request in the engine is taken (``gateway.limits.overload``): the server is
    working as designed, so the refusal is counted, not logged as an error."""

    default_code = "engine_overloaded"


class ShuttingDown(ServiceUnavailable):
    """The server ended the request to stop (``gateway.drain``): expected, so not logged as an error."""

    default_code = "shutting_down"


class RequestFailed(GatewayError):
    """The engine failed this request alone (a fault in a step it was part of) and serves on: a 500, with
    no Retry-After, since the same request may fail the same way; a real outage is a 503."""

    default_code = "request_failed"


class ClientError(GatewayError):
    status_code = 400
    error_type = "invalid_request_error"


class InvalidRequest(ClientError):
    pass


class NotFound(ClientError):
    status_code = 404
    error_type = "not_found_error"
    default_code = "not_found"


class Conflict(ClientError):
    status_code = 409
    error_type = "conflict_error"
    default_code = "conflict"


class AuthError(ClientError):
    status_code = 401
    error_type = "authentication_error"
    default_code = "invalid_api_key"


class Forbidden(ClientError):
    status_code = 403
    error_type = "permission_error"
    default_code = "forbidden"


class PolicyViolation(ClientError):
    """Refused by the tenant's policy; the status comes from the policy's ``Violation``."""

    def __init__(
        self, message: str, *, status: int = 400, code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message, code=code, param=param)
        self.status_code = status
        self.error_type = _TYPES_BY_STATUS.get(status, "invalid_request_error")


class QuotaExceeded(ClientError):
    status_code = 429
    error_type = "rate_limit_error"
    default_code = "rate_limit_exceeded"


def error_body(message: str, error_type: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    error_type: str,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response[Any]:
    return Response(error_body(message, error_type, code, param), status_code=status, headers=headers)


def _gateway_error_handler(_: Request, exc: GatewayError) -> Response[Any]:
    if exc.status_code >= 500 and not isinstance(exc, EngineOverloaded | ShuttingDown):
        log.error("request.error", error=exc.message, exc_info=exc)
    return error_response(exc.status_code, exc.message, exc.error_type, exc.code, exc.param, exc.headers)


def _http_exception_handler(_: Request, exc: HTTPException) -> Response[Any]:
    status = exc.status_code
    if status >= 500:
        log.error("request.error", exc_info=exc)
        return error_response(status, "Internal server error.", "server_error")
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
    return error_response(
        status,
        str(exc.detail),
        _TYPES_BY_STATUS.get(status, "invalid_request_error"),
        code,
        headers=dict(exc.headers or {}),
    )


def _audit_unavailable_handler(request: Request, exc: Exception) -> Response[Any]:
    if is_db_unavailable(exc) or is_db_full(exc):  # the trail's database cannot be written, not broken
        return _database_error_handler(request, exc)
    log.error("audit.unavailable", exc_info=exc)
    return error_response(
        503,
        "The audit trail is unavailable; the request was not processed.",
        "server_error",
        "audit_unavailable",
    )


# code -> (message, Retry-After seconds) of the database errors that pass: the client may retry.
_DATABASE_RETRY = {
    "database_unavailable": ("The database is unavailable; retry the request.", 1),
    "database_full": ("The database has no room to write (its disk is full); the request was not "
                      "processed. Retry later.", 10),
}


def _database_error_handler(request: Request, exc: Exception) -> Response[Any]:
    """The database out of reach (a lost connection, its server down or restarting: the pool reconnects
    for the next request) or full (its disk: nothing was written) is a 503 the client may retry; any
    other database error is a 500."""
    if is_db_unavailable(exc):
        code = "database_unavailable"
    elif is_db_full(exc):
        code = "database_full"
    else:
        return _unhandled_handler(request, exc)
    log.error(code.replace("_", "."), exc_info=exc)
    message, retry_after_s = _DATABASE_RETRY[code]
    return error_response(503, message, "server_error", code, headers={"Retry-After": str(retry_after_s)})


def _unhandled_handler(_: Request, exc: Exception) -> Response[Any]:
    log.error("request.unhandled", error_type=type(exc).__name__, exc_info=exc)
    return error_response(500, "Internal server error.", "server_error")


exception_handlers = {
    AuditUnavailableError: _audit_unavailable_handler,
    GatewayError: _gateway_error_handler,
    HTTPException: _http_exception_handler,
    DBAPIError: _database_error_handler,
    sqlite3.Error: _database_error_handler,  # raised unwrapped by the audit store's prepared statements
    Exception: _unhandled_handler,
}
