"""A thin keep-alive HTTP/1.1 client for the benches (stdlib asyncio): it shares the cores with the server
it measures, so its per-chunk cost is kept to a few microseconds."""
from __future__ import annotations

import asyncio


class HTTPConnection:
    """One keep-alive HTTP/1.1 connection that POSTs JSON and yields the lines of the response body
    (chunked or with a Content-Length) as they arrive. Stdlib only and thin: the client shares the
    cores with the server, so its per-chunk cost is kept to a few microseconds."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post_lines(self, path: str, body: bytes):
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        self.writer.write(head + body)
        reader = self.reader
        assert reader is not None
        status = await reader.readline()
        if not status:
            raise ConnectionError("the server closed the connection")
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
