"""Errors in the API's own format, with a fitting HTTP status: OpenAI's `{"error": {"message", "type", "param",
"code"}}` everywhere but under /v1/messages, where it is Anthropic's `{"type": "error", "error": {"type",
"message"}}` (`anthropic_path`: the one rule, applied wherever an error is rendered).

Every error the server sends has this body: APIError raised by handlers, Starlette's own 404 / 405
(`exception_handlers()`), and whatever escapes an endpoint or is cancelled at a forced shutdown
before its response started (`ErrorGuard`, which would otherwise leave uvicorn's plain-text 500).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}
# Anthropic's error types (docs.anthropic.com/en/api/errors); any other 4xx is an invalid_request_error. A 503
# (draining, no engine) keeps its status and is typed as Anthropic's 529: temporary, retry.
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
ANTHROPIC_PREFIX = "/v1/messages"


def anthropic_path(path: str) -> bool:
    """Errors on this path are rendered in Anthropic's format (the Messages API and anything under it)."""
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


class APIError(Exception):
    """An error a client caused or must wait out; rendered as an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {
            "message": self.message,
            "type": _ERROR_TYPES.get(self.status, "error"),
            "param": self.param,
            "code": self.code if self.code is not None else self.status,
        }}

    def anthropic_body(self) -> dict[str, Any]:
        kind = _ANTHROPIC_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, path: str = "") -> Response:
        """The error as a response; `path` (the request's) picks the format (`anthropic_path`)."""
        body = self.anthropic_body() if anthropic_path(path) else self.body()
        return Response(orjson.dumps(body), status_code=self.status, media_type="application/json",
                        headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def param_from_message(message: str, names: dict[str, str]) -> str | None:
    """Guess which parameter a ValueError message is about: the first known name it starts with.

    `names` maps internal names (SamplingParams fields) to the names the client used.
    """
    head = message.split(" ", 1)[0].strip(":,")
    if head in names:
        return names[head]
    for internal, public in names.items():
        if internal in message:
            return public
    return None


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", code="server_shutting_down")


def exception_handlers(on_error: Callable[[int], None] | None = None) -> dict[Any, Callable]:
    """Starlette handlers that render its HTTPExceptions (unknown path, wrong method) as OpenAI
    errors; `on_error(status)` is called for each (metrics)."""

    async def http_error(request: Request, exc: HTTPException) -> Response:
        if on_error is not None:
            on_error(exc.status_code)
        return _http_error(request, exc).response(request.url.path)

    return {HTTPException: http_error}


class ErrorGuard:
    """Pure ASGI middleware: an exception or cancellation before the response started is answered
    with an OpenAI error (500, or 503 when a forced shutdown cancelled the request), then re-raised
    so that the server still logs it (a cancellation is not: the stop that caused it was logged once).
    After the response started there is nothing left to send."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracking(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracking)
        except BaseException as exc:
            if not started:
                await _send_quietly(_guard_error(exc), scope, receive, send, scope.get("path", ""))
            if isinstance(exc, asyncio.CancelledError):  # a forced stop: said at the stop, no traceback per request
                logger.info("%s %s cancelled by the stop", scope["method"], scope["path"])
                return
            raise


# -- helpers ----------------------------------------------------------------------------------


def _http_error(request: Request, exc: HTTPException) -> APIError:
    where = f"{request.method} {request.url.path}"
    headers = dict(exc.headers or {})
    if exc.status_code == 404:
        return APIError(404, f"there is no endpoint at {request.url.path}", code="not_found")
    if exc.status_code == 405:
        allowed = sorted(m.strip() for m in headers.get("Allow", "").split(",") if m.strip())
        headers["Allow"] = ", ".join(allowed)
        return APIError(405, f"{request.method} is not allowed on {request.url.path}; use {' or '.join(allowed)}",
                        code="method_not_allowed", headers=headers)
    return APIError(exc.status_code, exc.detail or where, headers=headers)


def _guard_error(exc: BaseException) -> APIError:
    if isinstance(exc, asyncio.CancelledError):
        return APIError(503, "the server is shutting down; the request was cancelled", code="server_shutting_down")
    return APIError(500, f"internal error: {exc!r}", code="internal_error")


async def _send_quietly(error: APIError, scope: Scope, receive: Receive, send: Send, path: str) -> None:
    try:
        await error.response(path)(scope, receive, send)
    except Exception:  # the connection is already gone
        logger.debug("could not send the error response", exc_info=True)
