"""A thin keep-alive HTTP/1.1 client for the benches (stdlib asyncio): it shares the cores with the server
it measures, so its per-chunk cost is kept to a few microseconds."""
from __future__ import annotations

import asyncio


class HTTPConnection:
    """One keep-alive HTTP/1.1 connection that POSTs JSON and yields the lines of the response body
    (chunked or with a Content-Length) as they arrive. Stdlib only and thin: the client shares the
    cores with the server, so its per-chunk cost is kept to a few microseconds."""

    def __init__(self, host: str, port: int, headers: dict[str, str] | None = None) -> None:
        self.host, self.port = host, port
        self._extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())  # e.g. Authorization
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post_lines(self, path: str, body: bytes):
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\n{self._extra}Content-Length: {len(body)}\r\n\r\n").encode()
        reused = self.writer is not None and not self.writer.is_closing() and not self.reader.at_eof()
        if not reused:
            await self._connect()
        status = await self._send(head + body)
        if not status and reused:
            # A server may close a keep-alive connection that sat idle (llama.cpp's after 5 s) before it
            # reads the next request: nothing of it was processed, so it goes again on a new connection.
            await self._connect()
            status = await self._send(head + body)
        if not status:
            raise ConnectionError("the server closed the connection")
        reader = self.reader
        assert reader is not None
        code = int(status.split(b" ", 2)[1])
        headers: dict[bytes, bytes] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            key, _, value = line.partition(b":")
            headers[key.strip().lower()] = value.strip().lower()
        close = headers.get(b"connection") == b"close"
        if headers.get(b"transfer-encoding") == b"chunked":
            body_iter = self._chunked(reader)
        else:
            body_iter = self._sized(reader, int(headers.get(b"content-length", b"0")))
        if code != 200:
            data = b"".join([piece async for piece in body_iter])
            raise RuntimeError(f"HTTP {code}: {data[:500]!r}")
        pending = b""
        async for piece in body_iter:
            pending += piece
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r")
        if pending:
            yield pending
        if close:
            await self.close()

    async def _connect(self) -> None:
        await self.close()
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def _send(self, request: bytes) -> bytes:
        """The response's status line, or b"" if the server closed the connection before answering."""
        assert self.reader is not None and self.writer is not None
        try:
            self.writer.write(request)
            await self.writer.drain()
            return await self.reader.readline()
        except (ConnectionResetError, BrokenPipeError):
            return b""

    @staticmethod
    async def _chunked(reader: asyncio.StreamReader):
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return
            data = await reader.readexactly(size + 2)  # + CRLF
            yield data[:-2]

    @staticmethod
    async def _sized(reader: asyncio.StreamReader, length: int):
        if length:
            yield await reader.readexactly(length)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except (ConnectionError, OSError):
                pass
            self.writer = None
