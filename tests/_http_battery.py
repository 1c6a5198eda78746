"""Helpers for the bad-input battery: raw-socket HTTP, OpenAI error checks, the after-case guard.

The guard holds what must be true after every case, whatever the case sent: the server is
healthy, nothing answered 500/502/504 (nor 503 outside overload), the server logged no
traceback, and once idle the KV pool accounts for every slot with none locked or in flight.
"""
from __future__ import annotations

import json
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from radixserve.bench.soak_checks import held_by_requests
from radixserve.frontend.errors import anthropic_path

NEVER = frozenset({500, 502, 504})  # a bug whatever the input
_CODE_LINE = re.compile(r'^radixserve_http_responses_total\{code="(\d+)"\} (\d+)$', re.MULTILINE)


@dataclass
class RawResponse:
    """What came back on a raw socket, shaped like the parts of httpx.Response the checks read."""

    status_code: int
    headers: dict[str, str]
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.content)


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def connect(url: str, timeout: float = 30.0) -> socket.socket:
    return socket.create_connection(host_port(url), timeout=timeout)


def request_bytes(method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
                  content_length: int | None = None) -> bytes:
    """An HTTP/1.1 request with Connection: close; `content_length` may lie about the body."""
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    for key, value in (headers or {}).items():
        lines.append(f"{key}: {value}")
    if body is not None or content_length is not None:
        lines.append(f"Content-Length: {content_length if content_length is not None else len(body or b'')}")
    return "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + (body or b"")


def raw_exchange(url: str, data: bytes, timeout: float = 30.0) -> RawResponse:
    """Send `data` as is and read the answer until the server closes (Connection: close).

    The write side stays open: uvicorn takes a half-closed socket for a client that left.
    """
    with connect(url, timeout) as sock:
        sock.sendall(data)
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    return parse_response(b"".join(chunks))


def parse_response(raw: bytes) -> RawResponse:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines and lines[0].startswith("HTTP/1."), f"not an HTTP response: {raw[:200]!r}"
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        key, _, value = line.partition(":")
        headers[key.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = _dechunk(body)
    return RawResponse(status, headers, body)


def read_until(sock: socket.socket, marker: bytes, count: int, limit_s: float = 30.0) -> bytes:
    """Read until `marker` was seen `count` times (e.g. SSE events); fails on EOF first."""
    data = b""
    deadline = time.monotonic() + limit_s
    while data.count(marker) < count:
        assert time.monotonic() < deadline, f"only {data.count(marker)} of {count} {marker!r} in {data[:300]!r}"
        chunk = sock.recv(65536)
        assert chunk, f"the server closed after {data.count(marker)} of {count} {marker!r}: {data[:500]!r}"
        data += chunk
    return data


def _dechunk(body: bytes) -> bytes:
    out = b""
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += rest[:size]
        body = rest[size + 2:]
    return out


# -- answers --------------------------------------------------------------------------------


def assert_openai_error(response: Any) -> dict[str, Any]:
    """The body is `{"error": {"message", "type", "param", "code"}}` with a non-empty message."""
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(f"{response.status_code}: the error body is not JSON: {response.content[:300]!r}")
    assert isinstance(body, dict) and set(body) == {"error"}, f"{response.status_code}: {body!r}"
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"].strip(), error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert "application/json" in response.headers.get("content-type", ""), response.headers
    return error


def assert_anthropic_error(response: Any) -> dict[str, Any]:
    """The body is `{"type": "error", "error": {"type", "message"}}` with a non-empty message (/v1/messages)."""
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(f"{response.status_code}: the error body is not JSON: {response.content[:300]!r}")
    assert isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error", body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"type", "message"}, error
    assert isinstance(error["message"], str) and error["message"].strip(), error
    assert "application/json" in response.headers.get("content-type", ""), response.headers
    return error


def _path(response: Any) -> str:
    """The request path of an httpx response ("" for a raw-socket one)."""
    try:
        return response.request.url.path
    except (AttributeError, RuntimeError):
        return ""


def assert_answer(response: Any, expect: int | tuple[int, ...], allow_503: bool = False) -> dict[str, Any] | None:
    """Status as expected, never a 5xx bug, and every error in the API's format (Anthropic's under /v1/messages,
    else OpenAI's); the error if any."""
    status = response.status_code
    assert status not in NEVER, f"{status}: {response.content[:500]!r}"
    assert status != 503 or allow_503, f"503 outside overload/draining: {response.content[:300]!r}"
    expected = (expect,) if isinstance(expect, int) else expect
    assert status in expected, f"expected {expected}, got {status}: {response.content[:500]!r}"
    if 200 <= status < 300:
        return None
    if 300 <= status < 400:  # a redirect (trailing slash) carries no error body, but must say where
        assert response.headers.get("location"), response.headers
        return None
    return assert_anthropic_error(response) if anthropic_path(_path(response)) else assert_openai_error(response)


# -- the guard ------------------------------------------------------------------------------


@dataclass
class Guard:
    """Snapshot before a case; `check()` after it asserts the server came through unharmed."""

    server: Any
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.log_start = len(self.server.lines)
        self.codes_before = self.response_codes()
        self.stats_before = self.server.wait_idle(self.headers)["stats"]

    def response_codes(self) -> dict[str, int]:
        text = httpx.get(self.server.url + "/metrics", headers=self.headers, timeout=30).text
        return {code: int(n) for code, n in _CODE_LINE.findall(text)}

    def check(self, allow_503: bool = False) -> dict[str, Any]:
        """Health, no new 5xx or traceback, and the idle KV identity; the idle stats."""
        health = httpx.get(self.server.url + "/health", timeout=30)
        assert health.status_code == 200, f"unhealthy after the case: {health.status_code} {health.text!r}"
        info = self.server.wait_idle(self.headers)
        stats = info["stats"]
        assert_kv_identity(stats)
        codes = self.response_codes()
        bad = ("500", "502", "504") + (() if allow_503 else ("503",))
        new = {c: codes.get(c, 0) - self.codes_before.get(c, 0) for c in bad}
        log = "".join(self.server.lines[self.log_start:])
        assert not any(new.values()), f"the server answered {new} (maybe to a client that left):\n{log[-3000:]}"
        assert "Traceback" not in log, f"the server logged a traceback:\n{log[-3000:]}"
        return stats


def assert_kv_identity(stats: dict[str, Any]) -> None:
    """Idle: free + evictable (cached) + locked + in-flight == total, and nothing locked by requests (session pins
    may stay) or in flight."""
    total = stats["total_slots"]
    parts = {k: stats[k] for k in ("free_slots", "evictable_slots", "locked_slots", "in_flight_slots")}
    assert all(v >= 0 for v in parts.values()), stats
    assert sum(parts.values()) == total, f"KV accounting: {parts} does not sum to {total}"
    assert held_by_requests(stats) == 0 and parts["in_flight_slots"] == 0, f"leaked slots when idle: {parts}"
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
