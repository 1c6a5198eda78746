"""Access log: one INFO line per request on the logger `radixserve.access` (off with --disable-log-requests).

    127.0.0.1:51234 "POST /v1/chat/completions" 200 prompt_tokens=12 cached_tokens=8 completion_tokens=16 ttft=0.031s latency=0.205s

`AccessLog` is a pure ASGI middleware (BaseHTTPMiddleware would buffer streams): it puts an
`AccessRecord` into the request's scope, watches the status and body messages go out and logs
once the app returned, i.e. after the whole body was sent (for SSE: after the stream ended).
Handlers that generate add their token counts with `note_usage(request, ...)`, and streams mark
their first generated token with `note_first_token(request)`. TTFT is the time from the request's
arrival to that mark, or to the first body byte when nothing marked it (a non-streamed response:
then it equals the latency). Requests that generate nothing show `-` for the token counts and TTFT.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ACCESS_LOGGER = logging.getLogger("radixserve.access")
_SCOPE_KEY = "radixserve.access"


@dataclass
class AccessRecord:
    start: float  # time.perf_counter() at arrival
    status: int | None = None
    first_byte: float | None = None
    first_token: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int = 0
    completion_tokens: int = 0

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
        return (f'{who} "{scope["method"]} {scope["path"]}" {self.status or "-"} {tokens} '
                f"ttft={ttft} latency={end - self.start:.3f}s")


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

        async def send_watching(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            elif message["type"] == "http.response.body" and record.first_byte is None and message.get("body"):
                record.first_byte = time.perf_counter()
            await send(message)

        try:
            await self.app(scope, receive, send_watching)
        except BaseException:
            record.status = record.status or 500  # what the client got (ErrorGuard answers it)
            raise
        finally:
            ACCESS_LOGGER.info("%s", record.line(scope, time.perf_counter()))


def _record(request: Request) -> AccessRecord | None:
    return request.scope.get(_SCOPE_KEY)
