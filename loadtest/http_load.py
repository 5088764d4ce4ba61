"""Keep-alive HTTP/1.1 on asyncio for the load tools, with nothing beyond the standard library.

Used by ``loadtest.envoy_latency`` and the comparison harness
(``loadtest.compare_harness.client``). One request
at a time per :class:`Connection`; a :class:`Pool` keeps idle connections to one port and
opens new ones, up to a limit, when none is idle.
"""

from __future__ import annotations

import asyncio
import contextlib


class HttpError(Exception):
    """The answer was not a well-formed HTTP/1.1 response."""


class Connection:
    """One keep-alive HTTP/1.1 connection, one request at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.reusable = True

    @classmethod
    async def open(cls, port: int) -> Connection:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    def send(self, request: bytes) -> None:
        self.writer.write(request)

    async def exchange(self, request: bytes) -> int:
        """Send ``request``, read the whole response, return its status."""
        self.send(request)
        return await self.response()

    async def response(self) -> int:
        """Read one whole response; its status."""
        head = await self.reader.readuntil(b"\r\n\r\n")
        status_line, _, header_block = head.partition(b"\r\n")
        parts = status_line.split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise HttpError(f"bad status line {status_line[:60]!r}")
        status = int(parts[1])
        length, chunked = 0, False
        for line in header_block.lower().split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value:
                chunked = True
            elif name == b"connection" and b"close" in value:
                self.reusable = False
        if chunked:
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                await self.reader.readexactly(size + 2)
                if size == 0:
                    break
        elif length:
            await self.reader.readexactly(length)
        return status

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class Pool:
    """Idle keep-alive connections to one port; a new one when none is idle (up to ``limit``)."""

    def __init__(self, port: int, limit: int) -> None:
        self.port = port
        self.limit = limit
        self.idle: list[Connection] = []
        self.open = 0
        self.opened = 0
        self.freed = asyncio.Condition()

    async def fill(self, count: int) -> None:
        """Open ``count`` connections now, so a burst does not wait for handshakes."""
        for _ in range(min(count, self.limit)):
            self.idle.append(await Connection.open(self.port))
            self.open += 1
            self.opened += 1

    async def acquire(self) -> Connection:
        async with self.freed:
            while not self.idle and self.open >= self.limit:
                await self.freed.wait()
            if self.idle:
                return self.idle.pop()
            self.open += 1
        try:
            connection = await Connection.open(self.port)
        except BaseException:
            await self.release(None)
            raise
        self.opened += 1
        return connection

    async def release(self, connection: Connection | None) -> None:
        async with self.freed:
            if connection is not None and connection.reusable:
                self.idle.append(connection)
            else:
                self.open -= 1
                if connection is not None:
                    connection.close()
            self.freed.notify()

    def close(self) -> None:
        for connection in self.idle:
            connection.close()
        self.idle.clear()
