"""Server-sent events and disconnect-aware responses.

Both response paths watch the ASGI `receive` channel for `http.disconnect` while they work,
so a client that goes away cancels its producer, whose cleanup aborts the engine requests
(and frees their KV) even when no token has been sent yet.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

import orjson
from starlette.requests import Request
from starlette.types import Receive, Scope, Send


logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"

# JSON may hold U+0085, U+2028 and U+2029 raw, but line readers that split on Unicode line
# boundaries (httpx's iter_lines, str.splitlines) would cut a `data:` line there. Escaped, they
# are the same JSON string. In UTF-8 these byte runs encode only these characters.
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def sse_event(payload: Any, name: str | None = None) -> bytes:
    """One `data: {json}` event on one line; `name` adds its `event:` line (Anthropic's and the
    Responses API's streams name every event)."""
    head = b"event: " + name.encode() + b"\n" if name is not None else b""
    data = orjson.dumps(payload)
    for raw, escaped in _LINE_BREAKS:
        if raw in data:
            data = data.replace(raw, escaped)
    return head + b"data: " + data + b"\n\n"


class SSEResponse:
    """An ASGI response streaming `events` (already-encoded bytes) as text/event-stream."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None] | None = None) -> None:
        self.events = events
        self.on_close = on_close  # runs even if the stream never started (e.g. a send failed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._run(receive, send)
        finally:
            await _aclose(self.events)
            if self.on_close is not None:
                self.on_close()

    async def _run(self, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]})
        producer = asyncio.ensure_future(self._produce(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        done, _ = await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if producer not in done:
            logger.info("client disconnected mid-stream; aborting its requests")
        for task in (producer, watcher):
            task.cancel()
        results = await asyncio.gather(producer, watcher, return_exceptions=True)
        error = results[0]
        if isinstance(error, BaseException) and not isinstance(error, (asyncio.CancelledError, OSError)):
            logger.error("stream failed", exc_info=error)

    async def _produce(self, send: Send) -> None:
        async for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def run_watching_disconnect(request: Request, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Await `work` unless the client disconnects first (then `work` is cancelled).

    Returns (disconnected, result). The request body must have been read already.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if task in done:
        return False, task.result()
    await asyncio.gather(task, return_exceptions=True)
    return True, None


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _aclose(events: AsyncIterator[bytes]) -> None:
    close = getattr(events, "aclose", None)
    if close is not None:
        try:
            await close()
        except Exception:  # closing after an error; the error was already reported
            pass
