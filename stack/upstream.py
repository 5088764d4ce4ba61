"""The sample upstream app behind Envoy and HAProxy: answers every request with 200.

A minimal HTTP/1.1 server on asyncio (uvloop) with keep-alive, so that in benchmarks
the proxies and the rate limiter, not the app, set the pace. The body names the
upstream (``--name``), so a demo user sees which replica answered.

    python -m stack.upstream --port 8000 --name app-1
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import uvloop

from stack.processes import Child, free_port, tcp_answers

MAX_HEAD = 64 * 1024
"""Request heads larger than this get 431 and the connection is closed."""


def response(status: str, body: bytes, keep_alive: bool) -> bytes:
    """A complete HTTP/1.1 response with a plain-text body."""
    connection = b"keep-alive" if keep_alive else b"close"
    return (
        b"HTTP/1.1 "
        + status.encode()
        + b"\r\ncontent-type: text/plain\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\nconnection: "
        + connection
        + b"\r\n\r\n"
        + body
    )


def content_length(head: bytes) -> int:
    """The request's Content-Length (0 when absent); chunked bodies are not expected here."""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip() or 0)
    return 0


def wants_close(head: bytes) -> bool:
    """True when the client asked for ``Connection: close`` or spoke HTTP/1.0."""
    lowered = head.lower()
    return b"\r\nconnection: close" in lowered or lowered.split(b"\r\n", 1)[0].endswith(b"http/1.0")


class UpstreamProtocol(asyncio.Protocol):
    """One client connection: parse pipelined requests, answer each with 200."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.buffer = b""
        self.transport: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # uvloop's transports are not asyncio.Transport subclasses

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > MAX_HEAD:
                    self.transport.write(response("431 Request Header Fields Too Large", b"", False))
                    self.transport.close()
                return
            head = self.buffer[:end]
            try:
                length = content_length(head)
            except ValueError:
                self.transport.write(response("400 Bad Request", b"bad content-length\n", False))
                self.transport.close()
                return
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length :]
            close = wants_close(head)
            self.transport.write(response("200 OK", self.body, not close))
            if close:
                self.transport.close()
                return


async def serve(host: str, port: int, name: str) -> None:
    """Serve until SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    body = f"hello from {name}\n".encode()
    server = await loop.create_server(lambda: UpstreamProtocol(body), host, port, reuse_address=True)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print(f"upstream {name} listening on {host}:{port}", flush=True)
    async with server:
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--name", default="app", help="shown in every response body")
    arguments = parser.parse_args()
    uvloop.run(serve(arguments.host, arguments.port, arguments.name))


class UpstreamProcess(Child):
    """This app as a child (``python -m stack.upstream``), answering 200 with its name in the body."""

    def __init__(self, name: str, directory: Path, port: int = 0) -> None:
        self.port = port or free_port()
        argv = [sys.executable, "-m", "stack.upstream", "--port", str(self.port), "--name", name]
        super().__init__(name, argv, directory / f"{name}.log")

    def ready(self) -> bool:
        return tcp_answers(self.port)


if __name__ == "__main__":
    main()
