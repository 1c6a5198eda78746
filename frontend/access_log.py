"""Access log: one INFO line per request on the logger `radixserve.access` (off with --disable-log-requests).

    127.0.0.1:51234 "POST /v1/chat/completions" 200 prompt_tokens=12 cached_tokens=8 completion_tokens=16 ttft=0.031s latency=0.205s

On a server with API keys the line ends with the key's tenant (`tenant="acme"`, before any error part).

`AccessLog` is a pure ASGI middleware (BaseHTTPMiddleware would buffer streams): it puts an
`AccessRecord` into the request's scope, watches the status and body messages go out and logs
once the app returned, i.e. after the whole body was sent (for SSE: after the stream ended).
Handlers that generate add their token counts with `note_usage(request, ...)`, and streams mark
their first generated token with `note_first_token(request)`. TTFT is the time from the request's
arrival to that mark, or to the first body byte when nothing marked it (a non-streamed response:
then it equals the latency). Requests that generate nothing show `-` for the token counts and TTFT.

The status is what the client got: 499 when it hung up before the response ended (a stream cut
short, a request it gave up on). An error response, or an error event that ended a stream
(`note_error`), adds why, as the client read it:

    ... 400 ... latency=0.002s error=invalid_request_error param=temperature code=invalid_value message="..."

Health probes that pass (`note_probe`: a router or an orchestrator asks every few seconds) are
logged at DEBUG; a failing one at INFO like any request.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ACCESS_LOGGER = logging.getLogger("radixserve.access")
_SCOPE_KEY = "radixserve.access"
CLIENT_GONE = 499  # nginx's "client closed request": the client hung up before the response ended
_ERROR_BODY_MAX = 8192  # bytes of an error response read back for its line (OpenAI error bodies are short)


@dataclass
class AccessRecord:
    start: float  # time.perf_counter() at arrival
    status: int | None = None
    first_byte: float | None = None
    first_token: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int = 0
    completion_tokens: int = 0
    probe: bool = False  # a health probe: its passing answers are logged at DEBUG
    tenant: str | None = None  # the key's tenant, on a server with keys (frontend/tenants.py)
    complete: bool = False  # the last body message went out
    client_gone: bool = False  # the client disconnected before that
    error: dict[str, Any] | None = None  # the OpenAI error object the client got
    error_body: bytearray = field(default_factory=bytearray)

    def shown_status(self) -> int | None:
        return CLIENT_GONE if self.client_gone else self.status

    def level(self) -> int:
        status = self.shown_status()
        return logging.DEBUG if self.probe and status is not None and status < 400 else logging.INFO

    def line(self, scope: Scope, end: float) -> str:
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "-"
        if self.prompt_tokens is None:  # nothing generated: no token counts, no TTFT
            tokens, first = "prompt_tokens=- cached_tokens=- completion_tokens=-", None
        else:
            tokens = (f"prompt_tokens={self.prompt_tokens} cached_tokens={self.cached_tokens} "
                      f"completion_tokens={self.completion_tokens}")
            first = self.first_token or self.first_byte
        ttft = f"{first - self.start:.3f}s" if first is not None else "-"
        return (f'{who} "{scope["method"]} {scope["path"]}" {self.shown_status() or "-"} {tokens} '
                f"ttft={ttft} latency={end - self.start:.3f}s{self._tenant()}{self._why()}")

    def _tenant(self) -> str:
        return "" if self.tenant is None else " tenant=" + orjson.dumps(self.tenant).decode()

    def _why(self) -> str:
        error = self.error if self.error is not None else _error_of(bytes(self.error_body))
        if error is None:
            return ""
        message = orjson.dumps(str(error.get("message", ""))).decode()  # quoted: one line whatever it says
        return (f" error={error.get('type') or '-'} param={error.get('param') or '-'} "
                f"code={error.get('code') or '-'} message={message}")


def _error_of(body: bytes) -> dict[str, Any] | None:
    """The `error` object of an OpenAI error body, or None."""
    try:
        error = orjson.loads(body).get("error") if body else None
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return error if isinstance(error, dict) else None


def note_usage(request: Request, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> None:
    """Add a response's token counts to its access-log line (calls add up, e.g. per batch item)."""
    record = _record(request)
    if record is None:
        return
    record.prompt_tokens = (record.prompt_tokens or 0) + prompt_tokens
    record.cached_tokens += cached_tokens
    record.completion_tokens += completion_tokens


def note_openai_usage(request: Request, usage: dict[str, Any]) -> None:
    """note_usage from an OpenAI `usage` object."""
    note_usage(request, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
               usage["completion_tokens"])


def note_error(request: Request, error: dict[str, Any]) -> None:
    """An error object sent after the status line (an error event that ended a stream): its line says why."""
    record = _record(request)
    if record is not None:
        record.error = error


def note_tenant(request: Request, tenant: str) -> None:
    """The request's tenant, named in its line (on a server with keys; never the key)."""
    record = _record(request)
    if record is not None:
        record.tenant = tenant


def note_probe(request: Request) -> None:
    """A health probe: logged at DEBUG when it passes."""
    record = _record(request)
    if record is not None:
        record.probe = True


def note_first_token(request: Request) -> None:
    """Mark the first generated token of a stream (later calls change nothing)."""
    record = _record(request)
    if record is not None and record.first_token is None:
        record.first_token = time.perf_counter()


class AccessLog:
    """Pure ASGI middleware writing one `radixserve.access` line per HTTP request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not ACCESS_LOGGER.isEnabledFor(logging.INFO):
            await self.app(scope, receive, send)
            return
        record = scope[_SCOPE_KEY] = AccessRecord(start=time.perf_counter())

        async def receive_watching() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect" and not record.complete:
                record.client_gone = True
            return message

        async def send_watching(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            elif message["type"] == "http.response.body":
                _watch_body(record, message)
            await send(message)

        try:
            await self.app(scope, receive_watching, send_watching)
        except BaseException:
            record.status = record.status or 500  # what the client got (ErrorGuard answers it)
            raise
        finally:
            ACCESS_LOGGER.log(record.level(), "%s", record.line(scope, time.perf_counter()))


def _watch_body(record: AccessRecord, message: Message) -> None:
    body = message.get("body", b"")
    if body and record.first_byte is None:
        record.first_byte = time.perf_counter()
    if record.status is not None and record.status >= 400 and len(record.error_body) < _ERROR_BODY_MAX:
        record.error_body += body[:_ERROR_BODY_MAX - len(record.error_body)]
    if not message.get("more_body", False):
        record.complete = True


def _record(request: Request) -> AccessRecord | None:
    return request.scope.get(_SCOPE_KEY)
